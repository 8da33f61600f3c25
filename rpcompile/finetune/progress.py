"""The progress bar: tqdm when it is installed, else a plain line every few steps."""
from __future__ import annotations


class Progress:
    def __init__(self, total: int, initial: int = 0):
        self.total = total
        try:
            from tqdm.auto import tqdm
        except ImportError:
            self.bar = None
            self.every = max(1, (total - initial) // 20)
        else:
            self.bar = tqdm(total=total, initial=initial, unit="step", desc="fine-tuning", dynamic_ncols=True)

    def update(self, step: int, loss: float, tokens_per_s: float, step_s: float) -> None:
        text = f"loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s  {step_s * 1000:.0f} ms/step"
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step == self.total:
            print(f"step {step}/{self.total}  {text}", flush=True)

    def write(self, line: str) -> None:
        """Print a line without breaking the bar."""
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
