"""``torch_xla.test.test_utils``: the logging helpers torch_xla's example scripts (MNIST, ImageNet)
import: progress lines and TensorBoard summaries.

Example:
    >>> import torch_xla.test.test_utils as test_utils
    >>> test_utils.print_training(device, step, loss.item(), rate, global_rate, epoch)  # doctest: +SKIP
"""

from __future__ import annotations

import datetime

from xshard.compat import metrics


def now(format: str = "%H:%M:%S") -> str:
    """The local time, formatted."""
    return datetime.datetime.now().strftime(format)


def print_training(device, step, loss, rate, global_rate, epoch=None, summary_writer=None) -> None:
    """Prints one training progress line (and writes the loss and rates to ``summary_writer``)."""
    fields = [f"Training Device={device}"]
    if epoch is not None:
        fields.append(f"Epoch={epoch}")
    fields += [f"Step={step}", f"Loss={_number(loss):.5f}", f"Rate={_number(rate):.2f}",
               f"GlobalRate={_number(global_rate):.2f}", f"Time={now()}"]
    print("| " + " ".join(fields), flush=True)
    if summary_writer is not None:
        write_to_summary(summary_writer, step, {"loss": loss, "rate": rate,
                                                "global_rate": global_rate})


def print_test_update(device, accuracy, epoch=None, step=None) -> None:
    """Prints one evaluation progress line."""
    fields = [f"Test Device={device}"]
    if epoch is not None:
        fields.append(f"Epoch={epoch}")
    if step is not None:
        fields.append(f"Step={step}")
    if accuracy is not None:
        fields.append(f"Accuracy={_number(accuracy):.2f}")
    print("| " + " ".join(fields + [f"Time={now()}"]), flush=True)


def get_summary_writer(logdir):
    """A ``torch.utils.tensorboard.SummaryWriter`` writing to ``logdir`` (None: no writer).
    Needs the ``tensorboard`` package."""
    if not logdir:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=logdir)


def write_to_summary(summary_writer, global_step=None, dict_to_write=None,
                     write_xla_metrics: bool = False) -> None:
    """Writes each number of ``dict_to_write`` as a scalar at ``global_step`` (and, with
    ``write_xla_metrics``, xshard's counters)."""
    if summary_writer is None:
        return
    for name, value in (dict_to_write or {}).items():
        summary_writer.add_scalar(name, _number(value), global_step)
    if write_xla_metrics:
        for name in metrics.counter_names():
            summary_writer.add_scalar(f"xla/{name}", metrics.counter_value(name), global_step)


def close_summary_writer(summary_writer) -> None:
    """Flushes and closes ``summary_writer`` (None: nothing)."""
    if summary_writer is not None:
        summary_writer.flush()
        summary_writer.close()


def _number(value) -> float:
    """A Python number (reading a 0-d tensor)."""
    return float(value.item()) if hasattr(value, "item") else float(value)


__all__ = ["now", "print_training", "print_test_update", "get_summary_writer", "write_to_summary",
           "close_summary_writer"]
