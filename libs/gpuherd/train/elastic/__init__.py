"""Elastic data parallelism, the runtime half: training state that survives a change of world size.

The contract a rescale keeps is that the job trains as if it had never been resized:

- **One global sample order.** ``ElasticSampler`` fixes, per epoch, one permutation of the
  dataset (seeded by the job's seed and the epoch) and a global cursor. Every step consumes the
  next ``global_batch`` samples of that order whatever the world size, so after any rescale no
  sample of the epoch is skipped or seen twice.
- **A constant global batch.** A step is ``global_batch`` samples at every size: each of the
  ``world`` ranks runs ``accumulation_steps(global_batch, world, micro_batch)`` micro-batches and
  scales its loss by ``1 / accumulation``; DDP's average over ranks then gives the mean over the
  global batch, as one big batch would. A global batch that does not divide is refused with the
  sizes that would work.
- **All of the state.** ``ElasticState`` captures model, optimizer, LR scheduler, AMP grad
  scaler, step, sampler position and every RNG (Python, NumPy, torch CPU, the CUDA generator of
  the device the rank trains on) as one in-memory snapshot: what is committed at a step boundary,
  restored on a rollback, and broadcast from the oldest surviving rank to the ranks that join.

Its modules, by concern: ``sampler`` (the global sample order and batch), ``state`` (the snapshot
and the worker loop's steps), ``plans`` (the generations a worker follows), ``store`` (a
generation's rendezvous store) and ``membership`` (the handoff protocol between generations). The
warm standby a grow starts from is ``gpuherd.train.standby``.
"""

from gpuherd.train.elastic.errors import ElasticError, GlobalBatchError, is_collective_failure
from gpuherd.train.elastic.membership import Membership, Reporter
from gpuherd.train.elastic.plans import PlanFile, PlanSource, RescalePhases
from gpuherd.train.elastic.sampler import ElasticSampler, accumulation_steps, ledger
from gpuherd.train.elastic.state import ElasticState
from gpuherd.train.elastic.store import STORE_GENERATION_KEY, STORE_RETRY_EVERY_S, STORE_TRY_S

__all__ = [
    "STORE_GENERATION_KEY",
    "STORE_RETRY_EVERY_S",
    "STORE_TRY_S",
    "ElasticError",
    "ElasticSampler",
    "ElasticState",
    "GlobalBatchError",
    "Membership",
    "PlanFile",
    "PlanSource",
    "Reporter",
    "RescalePhases",
    "accumulation_steps",
    "is_collective_failure",
    "ledger",
]
