"""TensorBoard event files beside metrics.jsonl (logging.tensorboard = true): `tensorboard --logdir runs`.

Written with torch.utils.tensorboard.SummaryWriter (the `tensorboard` package, a dependency of
sao-megatron), imported here so a run without the sink never loads it. Only numbers are written, as
scalars under the metric's own name (train/pg_clipfrac, ...), at the trainer step.

A resumed run logs again from its checkpoint's step + 1, and event files of the earlier attempt may
hold later steps. The writer is opened at the first logged step with purge_step = that step, so
TensorBoard hides every older event at or after it (SummaryWriter's purge_step: a SessionLog.START
event at that step), as metrics.jsonl is cut back (rewind.py).
"""
from __future__ import annotations

from pathlib import Path

from .seam import MetricSink, to_float


class TensorBoardSink(MetricSink):
    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError("TensorBoard needs the `tensorboard` package: pip install tensorboard "
                              "(or set logging.tensorboard = false)") from err
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.log_dir = Path(log_dir)
        self._open = lambda step: SummaryWriter(log_dir=str(log_dir), purge_step=step)
        self._writer = None

    def log(self, metrics, step):
        if self._writer is None:
            self._writer = self._open(step)
        for key, value in metrics.items():
            number = to_float(value)
            if number is not None:
                self._writer.add_scalar(key, number, global_step=step)
        self._writer.flush()   # a crashed run keeps every step logged so far

    def close(self):
        if self._writer is not None:
            self._writer.close()
