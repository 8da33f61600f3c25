"""Checkpoints in the layout of the original model, written atomically.

A checkpoint directory holds what ``AutoModelForCausalLM.from_pretrained(DIR)`` reads
(``config.json`` + ``model.safetensors``, keys exactly ``model.state_dict()``'s, a tied
weight stored once as transformers does; sharded with an index past 5 GB) or, for LoRA, what
``PeftModel.from_pretrained(base, DIR)`` reads; the tokenizer; the plots; and the side file
``trainer_state.pt`` (optimizer state, step, RNG states, data position, run settings).
A LoRA adapter on a base that exists nowhere else (a built-in shape's random weights) gets that
base beside it, as a model checkpoint of its own in ``DIR/base``, and its adapter_config.json
names that directory (absolute) as ``base_model_name_or_path``, so
``AutoPeftModelForCausalLM.from_pretrained(DIR)`` loads base and adapter together.

Note [atomic save]
Everything is written into a hidden sibling ``.DIR.tmp-<pid>-<hex>``, every file and the
directory fsynced, then published: on Linux one ``renameat2(RENAME_EXCHANGE)`` swaps the new
directory with the old one atomically (then the old one is deleted); elsewhere the old one
is first renamed to ``.DIR.old-<hex>`` and the new one renamed into place. A crash while
writing leaves DIR as it was (at worst plus a hidden ``.tmp`` sibling, never trusted and
removed by the next save). A crash between the two fallback renames leaves DIR missing and
its complete previous version in ``.DIR.old-*``, which ``recover`` puts back before any
read or write of DIR. ``trainer_state.pt`` is written last, so a directory without it is
never a checkpoint.
"""
from __future__ import annotations

import copy
import ctypes
import errno
import json
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from .errors import UsageError

STATE_FILE = "trainer_state.pt"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 1024**3
STATE_FORMAT = "rpcompile-finetune/1"
BASE_DIR = "base"          # a LoRA checkpoint's frozen base, where it exists nowhere else


def is_checkpoint(directory) -> bool:
    return Path(directory, STATE_FILE).is_file()


def check_save_target(directory, resume=None) -> Path:
    """Refuse early (before training) a --save path we must not replace: anything but an empty
    directory or the checkpoint this run resumes (another run's checkpoint, replaced by a run that
    forgot --resume, was lost without a word)."""
    directory = Path(directory)
    recover(directory)
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--save {directory}: exists and is not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not is_checkpoint(directory):
        raise UsageError(f"--save {directory}: exists and is not an rpcompile checkpoint; "
                         f"refusing to replace it (pick a new or empty directory)")
    if is_checkpoint(directory) and (resume is None or Path(resume).resolve() != directory.resolve()):
        raise UsageError(f"--save {directory}: holds the checkpoint of another run (step "
                         f"{read_state(directory)['step']}); continue it with --resume {directory} --save "
                         f"{directory}, or pick a new or empty directory")
    try:  # find out now, not after the training, whether the directory beside it is writable
        directory.absolute().parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=f".{directory.name}.probe-", dir=directory.absolute().parent))
    except OSError as e:
        raise UsageError(f"--save {directory}: cannot write there ({e.strerror or e})") from None
    return directory


def is_peft(model) -> bool:
    return hasattr(model, "peft_config")


def save_checkpoint(directory, model, tokenizer, state: dict, extra_writer=None, save_base=False) -> None:
    """Write a checkpoint of ``model`` to ``directory`` atomically (Note [atomic save]).
    ``extra_writer(tmp_dir)`` may add files (the plots) before the state file closes it.
    ``save_base`` (a peft model): also its frozen base, in ``directory/base``, named by the
    adapter's config (module docstring); the weights files of the base a previous save there
    wrote are hard-linked, not written again, when they hold the same tensors."""
    directory = Path(directory).absolute()
    directory.parent.mkdir(parents=True, exist_ok=True)
    recover(directory)
    _remove_leftovers(directory)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        _write_model(tmp, model)
        tokenizer.save_pretrained(tmp)
        if save_base and is_peft(model):
            _write_base(tmp / BASE_DIR, model, tokenizer, previous=directory / BASE_DIR)
            _name_adapter_base(tmp, directory / BASE_DIR)
        if extra_writer is not None:
            extra_writer(tmp)
        torch.save({"format": STATE_FORMAT, **state}, tmp / STATE_FILE)
        _fsync_tree(tmp)
        _publish(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_state(directory) -> dict:
    directory = Path(directory)
    recover(directory)
    if not is_checkpoint(directory):
        raise UsageError(f"--resume {directory}: not an rpcompile checkpoint (no {STATE_FILE})")
    state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
    if state.get("format") != STATE_FORMAT:
        raise UsageError(f"--resume {directory}: {STATE_FILE} has format {state.get('format')!r}, "
                         f"expected {STATE_FORMAT!r}")
    return state


def recover(directory) -> None:
    """Finish a fallback swap that a crash interrupted (Note [atomic save])."""
    directory = Path(directory)
    if directory.exists() or not directory.parent.is_dir():
        return
    olds = [p for p in directory.parent.glob(f".{directory.name}.old-*") if is_checkpoint(p)]
    if olds:
        os.rename(max(olds, key=lambda p: p.stat().st_mtime), directory)
        _fsync_dir(directory.parent)


# -- writing -------------------------------------------------------------------------------

def _write_model(directory: Path, model) -> None:
    if is_peft(model):  # the adapter, the peft way: adapter_config.json + adapter_model.safetensors
        model.save_pretrained(str(directory), save_embedding_layers=False)
        return
    _write_config(directory, model)
    _write_weights(directory, _unique_tensors(model.state_dict()))


def _write_config(directory: Path, model) -> None:
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.use_cache = True  # training turns the KV cache off; whoever loads this may generate
    config.save_pretrained(str(directory))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(directory))


def _write_base(target: Path, model, tokenizer, previous: Path) -> None:
    """The frozen base under a peft model as a model checkpoint (config, weights under the
    unwrapped model's names, tokenizer); its weights files hard-linked from ``previous`` (the
    checkpoint this save replaces) when those hold the same tensors: the base never changes, and
    a large one is not written again at every save."""
    base = model.get_base_model()
    target.mkdir()
    _write_config(target, base)
    tokenizer.save_pretrained(target)
    tensors = _unique_tensors({name.replace(".base_layer", ""): t for name, t in base.state_dict().items()
                               if "lora_" not in name})
    if not _link_same_weights(previous, target, tensors):
        _write_weights(target, tensors)


def _link_same_weights(previous: Path, target: Path, tensors: dict) -> bool:
    """Hard-link ``previous``'s weights files into ``target`` if they hold ``tensors`` (same
    config, names, shapes and dtypes, and the same first row of each); False (nothing linked)
    otherwise or where links are not possible."""
    files = sorted(previous.glob("model*.safetensors"))
    try:
        if not files or (previous / "config.json").read_bytes() != (target / "config.json").read_bytes():
            return False
        from safetensors import safe_open

        seen = set()
        for f in files:
            with safe_open(str(f), "pt") as h:
                for name in h.keys():
                    t, stored = tensors.get(name), h.get_slice(name)
                    if (t is None or t.dim() == 0 or list(stored.get_shape()) != list(t.shape)
                            or not torch.equal(stored[:1], t[:1])):
                        return False
                    seen.add(name)
        if seen != set(tensors):
            return False
        for f in files + ([previous / WEIGHTS_INDEX] if (previous / WEIGHTS_INDEX).is_file() else []):
            os.link(f, target / f.name)
        return True
    except Exception:   # unreadable, or no hard links here: write them instead
        for f in target.glob("model*.safetensors*"):
            f.unlink()
        return False


def _name_adapter_base(directory: Path, base: Path) -> None:
    """Point the adapter's config (and peft's model card) at ``base``, where it will be."""
    config_path = directory / "adapter_config.json"
    config = json.loads(config_path.read_text())
    old, config["base_model_name_or_path"] = config.get("base_model_name_or_path"), str(base)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    card = directory / "README.md"
    if old and card.is_file():
        card.write_text(card.read_text().replace(old, str(base)))


def _unique_tensors(state_dict) -> dict:
    """state_dict() names; a tensor tied to an earlier one (lm_head to embed_tokens) once,
    under its first name, as transformers writes it and re-ties it when loading."""
    seen, out = set(), {}
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().to("cpu").contiguous()
    return out


def _write_weights(directory: Path, tensors: dict) -> None:
    from safetensors import torch as st  # looked up at call time: tests patch st.save_file

    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > MAX_SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        st.save_file(shards[0], str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        st.save_file(shard, str(directory / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # directories cannot be opened on some platforms (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


# -- publishing ----------------------------------------------------------------------------

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2); False where that is not supported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _publish(tmp: Path, directory: Path) -> None:
    if not directory.exists():
        os.rename(tmp, directory)
    elif _exchange(tmp, directory):
        shutil.rmtree(tmp, ignore_errors=True)  # the swap put the previous checkpoint here
    else:
        old = directory.parent / f".{directory.name}.old-{secrets.token_hex(4)}"
        os.rename(directory, old)
        try:
            os.rename(tmp, directory)
        except BaseException:
            os.rename(old, directory)
            raise
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(directory.parent)


def _remove_leftovers(directory: Path) -> None:
    """Hidden siblings from a killed save (never trusted: see Note [atomic save])."""
    for pattern in (f".{directory.name}.tmp-*", f".{directory.name}.old-*"):
        for p in directory.parent.glob(pattern):
            shutil.rmtree(p, ignore_errors=True)
