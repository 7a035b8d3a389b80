"""Imported into a torchtitan run by a test (``--experimental.custom_import``): a slow link
between the replicas, as the advisor meets it on one.

* Each round's reduce-scatter waits ``LINK_S`` more on the communication thread: time on the
  wire, which takes no CPU (a shaped link), inside the job the advisor times as C.
* The step end's metrics all-reduce waits until the round's communication is done, as on a real
  slow link, where it is queued behind the round's traffic.
* Each micro-batch's data and forward and backward are timed here; when the run closes, each
  rank prints the median time of those the advisor timed (the same micro-batches) beside the
  advisor's compute per micro-batch (K over the round's micro-batches).
* Each step's start records whether a round's communication is still in flight: what the step
  end between two steps waited for (torchtitan's ``checkpointer.save``, called after every step,
  once waited for θ, the update in flight, even where it wrote nothing).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch.distributed as dist

import acco_hooks.engine.communication as communication
from acco_hooks.engine.advisor import Advisor
from acco_hooks.titan.base import ACCOTrainerBase
from tests.titan import small_model  # noqa: F401  (the tests' model: a job has one custom_import)

LINK_S = 0.3

_reduce_scatter_sum = communication.reduce_scatter_sum
_log_pending_metrics = ACCOTrainerBase._log_pending_metrics
_next_microbatch = ACCOTrainerBase._next_microbatch
_forward_backward_step = ACCOTrainerBase.forward_backward_step
_close = ACCOTrainerBase.close
_train_step = ACCOTrainerBase.train_step
_record_microbatch = Advisor.record_microbatch
_data_s: list[float] = [0.0]  # the micro-batch under way's
_compute_s: list[float] = []  # each micro-batch's data, forward and backward
_timed_by_advisor: list[float] = []  # those of the micro-batches the advisor timed
_in_flight_at_step_start: list[bool] = []


def _over_a_slow_link(*args: Any, **kwargs: Any) -> Any:
    time.sleep(LINK_S)
    return _reduce_scatter_sum(*args, **kwargs)


def _metrics_behind_the_round(trainer: ACCOTrainerBase) -> None:
    engine = trainer.optimizers.engine
    while engine.communication_in_flight:
        time.sleep(0.001)
    _log_pending_metrics(trainer)


def _timed_data(trainer: ACCOTrainerBase, *args: Any, **kwargs: Any) -> Any:
    start = time.perf_counter()
    batch = _next_microbatch(trainer, *args, **kwargs)
    _data_s[0] = time.perf_counter() - start
    return batch


def _timed_forward_backward(trainer: ACCOTrainerBase, *args: Any, **kwargs: Any) -> Any:
    start = time.perf_counter()
    loss = _forward_backward_step(trainer, *args, **kwargs)
    _compute_s.append(_data_s[0] + time.perf_counter() - start)
    return loss


def _record_microbatch_beside_its_compute(advisor: Advisor, *args: Any, **kwargs: Any) -> None:
    if not advisor.figures:
        _timed_by_advisor.append(_compute_s[-1])
    _record_microbatch(advisor, *args, **kwargs)


def _step_after_the_step_end(trainer: ACCOTrainerBase, *args: Any, **kwargs: Any) -> None:
    if trainer.step > 1:
        _in_flight_at_step_start.append(trainer.optimizers.engine.communication_in_flight)
    _train_step(trainer, *args, **kwargs)


def _report_then_close(trainer: ACCOTrainerBase, **kwargs: Any) -> None:
    engine = trainer.optimizers.engine
    figures = engine.advisor.figures
    if figures:
        per_microbatch = figures["compute_per_round_s"] / engine.last_round_microbatches
        print(f"slow link: rank {dist.get_rank()} compute {statistics.median(_timed_by_advisor):.4f} "
              f"advisor {per_microbatch:.4f} comm {figures['comm_per_round_s']:.4f}", flush=True)  # fmt: skip
    print(f"slow link: rank {dist.get_rank()} in flight at {sum(_in_flight_at_step_start)} of "
          f"{len(_in_flight_at_step_start)} step starts", flush=True)  # fmt: skip
    _close(trainer, **kwargs)


communication.reduce_scatter_sum = _over_a_slow_link
ACCOTrainerBase._log_pending_metrics = _metrics_behind_the_round
ACCOTrainerBase._next_microbatch = _timed_data
ACCOTrainerBase.forward_backward_step = _timed_forward_backward
ACCOTrainerBase.close = _report_then_close
ACCOTrainerBase.train_step = _step_after_the_step_end
Advisor.record_microbatch = _record_microbatch_beside_its_compute
