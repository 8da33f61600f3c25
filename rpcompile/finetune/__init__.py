"""``rpcompile-finetune``: fine-tune a causal language model with rpcompile.

Run ``rpcompile-finetune`` (or ``python -m rpcompile.finetune``) with no arguments for the
built-in example: a tiny Qwen3-style model learns the first chapters of Alice in Wonderland
on two CPU devices (worker threads) in about a minute. ``rpcompile-finetune --help`` lists the options.

One concern per module: ``cli`` (arguments and their checks), ``train`` (the loop),
``data``, ``tokenizer``, ``models``, ``engine`` (the seam to ``rpcompile.compile``),
``checkpoint`` (atomic saves, resume), ``plots``, ``progress``, ``report`` (the rotation line,
time estimates, Ctrl-C).
"""
from .cli import main

__all__ = ["main"]
