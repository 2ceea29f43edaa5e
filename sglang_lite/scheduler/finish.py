"""Ending requests and reporting them: the outputs a step sends (new tokens and text, ``meta_info``), finishing
(text flushed, memory released and cached), failing (no flush, nothing cached: status 500 with the error, 400 for
a grammar's dead end or overrun mask budget) and
the parallel samples that end before they were forked."""

from __future__ import annotations

import logging
import time
from typing import Any

from sglang_lite.mem_cache.request_memory import RequestMemory
from sglang_lite.protocol.outputs import BAD_REQUEST, INTERNAL_ERROR, ReqOutput
from sglang_lite.sampling.grammar import GrammarQueue
from sglang_lite.sampling.grammar_cost import GrammarFault
from sglang_lite.sampling.logprobs import LogprobRecord
from sglang_lite.scheduler.faults import breaks_the_device, describe, is_out_of_memory
from sglang_lite.scheduler.queues import RequestQueues
from sglang_lite.scheduler.request import FinishReason, Req, ReqStatus

logger = logging.getLogger(__name__)


class RequestEnder:
    def __init__(
        self,
        memory: RequestMemory,
        queues: RequestQueues,
        grammar_queue: GrammarQueue,
        report_speculation: bool = False,
    ) -> None:
        """``report_speculation``: ``meta_info`` carries the request's verify steps and accepted drafts."""
        self.report_speculation = report_speculation
        self.memory = memory
        self.queues = queues
        self.grammar_queue = grammar_queue
        self.outputs: list[ReqOutput] = []

    # ---- ending -------------------------------------------------------------------------------------------------
    def finish(self, req: Req, reason: FinishReason) -> None:
        if not (reason.kind == "stop" and isinstance(reason.matched, str)):
            self._flush_text(
                req
            )  # a stop string already emitted the text before it and dropped the rest
        self.end(req, reason)

    def fail_request(self, req: Req, error: Exception) -> None:
        """One request raised: it fails alone, unless the error broke the device (then the rank must go)."""
        if breaks_the_device(error) or is_out_of_memory(error):
            raise error
        logger.warning(
            "request %s failed: %s: %s", req.rid, type(error).__name__, error, exc_info=error
        )
        self.fail(req, error)

    def fail(self, req: Req, error: Exception) -> None:
        """Ends a request with the error; no text flush (the detokeniser may be what failed). A grammar's dead end,
        or masks too expensive to follow, is the request's own fault: status 400 with its message."""
        if isinstance(error, GrammarFault):
            self.end(req, FinishReason("abort", message=str(error), status_code=BAD_REQUEST))
            return
        self.end(req, FinishReason("abort", message=describe(error), status_code=INTERNAL_ERROR))

    def end(self, req: Req, reason: FinishReason) -> None:
        if req.holds_memory:  # a failed step's KV may be half-written: not cached
            self.memory.release(req, cache=not reason.is_internal_error)
        self.queues.take_out(req)
        self.grammar_queue.remove(req)
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        # its parallel samples were never forked (max_new_tokens 0, an abort): they end with it, each with the
        # prompt's log-probabilities it computed
        prompt = req.logprob_record.copy_input() if req.forks else None
        self.emit(req)
        for rid in req.forks:
            self.emit_unforked(req, rid, reason, prompt)
        req.forks = []

    def end_keeping_memory(self, req: Req, reason: FinishReason) -> None:
        """Ends a request whose memory is released later by its owner (a PD reservation still being written)."""
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        self.emit(req)

    def add_text(self, req: Req, text: str) -> None:
        req.unsent_text += req.stop_matcher.feed(text) if req.stop_matcher else text

    def _flush_text(self, req: Req) -> None:
        if req.detokenizer is not None:
            self.add_text(req, req.detokenizer.flush())
        if req.stop_matcher is not None and req.stop_matcher.matched is None:
            req.unsent_text += req.stop_matcher.flush()

    # ---- outputs ------------------------------------------------------------------------------------------------
    def emit(self, req: Req) -> None:
        output = ReqOutput(
            req.rid, req.unsent_ids, req.unsent_text, req.finished, self._meta_info(req)
        )
        self.outputs.append(output)
        req.unsent_ids = []
        req.unsent_text = ""

    def emit_unforked(
        self, parent: Req, rid: str, reason: FinishReason, prompt: LogprobRecord | None = None
    ) -> None:
        """A parallel sample that ends before it was forked (its parent ended, or it was aborted); ``prompt``:
        the log-probabilities of the prompt its parent computed."""
        meta = {
            "id": rid,
            "prompt_tokens": len(parent.input_ids),
            "completion_tokens": 0,
            "cached_tokens": 0,
            "finish_reason": reason.to_dict(),
            "num_retractions": 0,
            "e2e_latency": time.monotonic() - parent.arrival_time,
        }
        if prompt is not None and parent.logprob is not None and parent.logprob.return_logprob:
            meta.update(prompt.copy_input().take(parent.logprob))
        self.outputs.append(ReqOutput(rid, [], "", True, meta))

    def take_outputs(self) -> list[ReqOutput]:
        outputs = self.outputs
        self.outputs = []
        return outputs

    def _meta_info(self, req: Req) -> dict[str, Any]:
        meta = {
            "id": req.rid,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.prompt_tokens_from_cache,
            "finish_reason": req.finish_reason.to_dict() if req.finish_reason else None,
            "num_retractions": req.num_retractions,
        }
        if self.report_speculation:
            meta.update(_speculation(req))
        if req.finished:
            meta["e2e_latency"] = time.monotonic() - req.arrival_time
        if req.logprob is not None and req.logprob.return_logprob:
            meta.update(req.logprob_record.take(req.logprob))
        return meta


def _speculation(req: Req) -> dict[str, Any]:
    """SGLang's speculative ``meta_info``: verify steps, drafts accepted and proposed, tokens per verify step
    (completion tokens over verify steps), accepted over proposed."""
    verify, drafted = req.spec_verify_ct, req.spec_drafted
    return {
        "spec_verify_ct": verify,
        "spec_accept_token_num": req.spec_accepted_drafts,
        "spec_draft_token_num": drafted,
        "spec_accept_length": len(req.output_ids) / verify if verify else 0.0,
        "spec_accept_rate": req.spec_accepted_drafts / drafted if drafted else 0.0,
    }
