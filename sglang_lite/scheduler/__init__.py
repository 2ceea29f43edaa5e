"""The continuous-batching scheduler: request state, admission policy, batches and load figures."""

from sglang_lite.scheduler.config import SchedulerConfig
from sglang_lite.scheduler.loads import SchedulerLoads
from sglang_lite.scheduler.request import FinishReason, Req, ReqOutput, ReqStatus
from sglang_lite.scheduler.scheduler import Scheduler, validate_request

__all__ = [
    "FinishReason",
    "Req",
    "ReqOutput",
    "ReqStatus",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerLoads",
    "validate_request",
]
