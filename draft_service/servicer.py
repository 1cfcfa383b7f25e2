"""The Draft gRPC servicer: protobuf in, drafter call (:class:`BaseDrafter`: a model or the
replay draft), protobuf out.

Fault injection for tests: ``SPLITSPEC_INJECT_DRAFT_FAULT=malformed_tree``
makes the servicer corrupt every other tree it sends on a stream (the 1st,
3rd, 5th, ...: one extra node whose token id is vocab_size and whose parent
index points forward), so that the target's tree validation can be tested end
to end while the target still verifies the intact trees (its warmup needs
some). ``SPLITSPEC_INJECT_DRAFT_FAULT=slow`` holds the reply to every 8th
step for half a second, past a short target deadline. Read when the servicer
is built (the start_server step); an unknown value fails that step.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import grpc

from draft_service.drafter import BaseDrafter, SeqInput, SeqResult, TreeShape
from draft_service.models import DraftSpec
from splitspec import telemetry
from splitspec.feature_memory import FeatureMap
from splitspec.init_report import InitReport
from splitspec.mailbox import REFUSED, ExchangeRequests, MailboxError
from splitspec.sampling import SamplingParams
from splitspec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)

_TRACER = telemetry.tracer("splitspec.draft")
DRAFT_FAULT_ENV = "SPLITSPEC_INJECT_DRAFT_FAULT"
DRAFT_FAULTS = ("malformed_tree", "slow")
SLOW_REPLY_S = 0.5  # the "slow" fault holds the reply to every 8th step this long


def draft_fault_from_env(env: dict[str, str] | None = None) -> str:
    """The draft fault to inject ("" = none); ValueError for an unknown one."""
    fault = (env if env is not None else os.environ).get(DRAFT_FAULT_ENV, "")
    if fault and fault not in DRAFT_FAULTS:
        raise ValueError(f"{DRAFT_FAULT_ENV}={fault!r} is not one of {DRAFT_FAULTS}")
    return fault


def draft_info(spec: DraftSpec, max_context: int, sampled_trees: bool = False
               ) -> draft_pb2.DraftInfo:
    return draft_pb2.DraftInfo(
        kind=spec.kind,
        model_name=spec.name,
        vocab_size=spec.vocab_size,
        tokenizer_sha256=spec.tokenizer_sha256,
        needs_hidden_states=spec.needs_hidden_states,
        target_hidden_size=spec.target_hidden_size,
        aux_layer_inputs=list(spec.aux_layer_inputs),
        target_num_layers=spec.target_num_layers,
        max_context=max_context,
        sampled_trees=sampled_trees,
    )


def seq_input_from_pb(pb: draft_pb2.SeqDraftInput, memory: FeatureMap | None = None
                      ) -> SeqInput:
    """The drafter's input; features the target put in shared memory (``memory``, the
    request's feature_memory) are copied out of it."""
    hidden_states = pb.hidden_states
    if pb.HasField("hidden_states_at"):
        if memory is None:
            raise ValueError(f"sequence {pb.seq_id}: hidden_states_at without the request's "
                             "feature_memory")
        hidden_states = memory.read(pb.hidden_states_at.offset, pb.hidden_states_at.length)
    return SeqInput(
        seq_id=pb.seq_id, start=pb.start, new_tokens=list(pb.new_tokens),
        shape=TreeShape(pb.shape.num_draft_tokens, pb.shape.topk, pb.shape.num_steps),
        hidden_states=hidden_states, hidden_dim=pb.hidden_dim, dtype=pb.dtype,
        sampling=SamplingParams.from_pb(pb.sampling) if pb.HasField("sampling") else None)


def tree_to_pb(result: SeqResult) -> draft_pb2.DraftTree:
    return draft_pb2.DraftTree(
        seq_id=result.seq_id, tokens=result.tree.tokens, parents=result.tree.parents,
        error=result.error,
        proposals=[draft_pb2.Proposal(tokens=p.tokens, probs=p.probs) for p in result.tree.proposals])


def corrupt(tree: draft_pb2.DraftTree, vocab_size: int) -> None:
    """Append a node the target must reject: token id vocab_size, parent after itself."""
    num = len(tree.tokens)
    tree.tokens.append(vocab_size)
    tree.parents.append(num + 2)


class DraftServicer(draft_pb2_grpc.DraftServicer):
    """Each Exchange stream gets its own session; its sequences are freed when it ends."""

    def __init__(self, drafter: BaseDrafter, info: draft_pb2.DraftInfo, report: InitReport,
                 fault: str = "") -> None:
        self.drafter = drafter
        self.info = info
        self.report = report
        self.fault = fault

    def Exchange(self, request_iterator: Iterator[draft_pb2.DraftRequest],
                 context: grpc.ServicerContext) -> Iterator[draft_pb2.DraftReply]:
        session = self.drafter.open_session()
        num_sent = 0
        memory: FeatureMap | None = None  # the stream's feature memory, opened at first use
        # the requests, from the stream, or from the target's mailbox once one names it
        requests = ExchangeRequests(request_iterator, lambda: not context.is_active())
        log.info("draft stream opened by %s", context.peer())
        try:
            for request in requests:
                if request.feature_memory and (memory is None
                                               or memory.path != request.feature_memory):
                    if memory is not None:
                        memory.close()
                    memory = None  # (if the next line fails, the finally has nothing to close)
                    memory = FeatureMap(request.feature_memory)
                if request.mailbox:
                    log.info("draft stream from %s continues through the mailbox %s",
                             context.peer(), request.mailbox)
                reply = self._reply(session, request, memory)
                if self.fault == "malformed_tree":
                    for tree in reply.trees[num_sent % 2::2]:
                        corrupt(tree, self.info.vocab_size)
                if self.fault == "slow" and request.step % 8 == 0:
                    time.sleep(SLOW_REPLY_S)
                num_sent += len(reply.trees)
                if (on_stream := requests.answer(reply)) is not None:
                    yield on_stream
        except grpc.RpcError:
            if context.is_active():
                raise
            # The target cancelled its stream (it stops or reconnects): the normal end of a stream.
            log.info("draft stream from %s cancelled by the client", context.peer())
        except MailboxError as exc:  # the stream fails, saying why
            log.warning("draft stream from %s: %s: %s", context.peer(), REFUSED, exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{REFUSED}: {exc}")
        finally:
            requests.close()
            if memory is not None:
                memory.close()
            self.drafter.close_session(session)
            log.info("draft stream from %s closed", context.peer())

    def _reply(self, session: object, request: draft_pb2.DraftRequest,
               memory: FeatureMap | None) -> draft_pb2.DraftReply:
        start = time.perf_counter()
        links = telemetry.links_to([s.traceparent for s in request.seqs]) if telemetry.enabled() else []
        with _TRACER.start_as_current_span(
                "draft.exchange", context=telemetry.context_from(request.traceparent),
                links=links) as span:
            results = self.drafter.draft(session,
                                         [seq_input_from_pb(s, memory) for s in request.seqs],
                                         request.release_ids)
            trees = [tree_to_pb(r) for r in results]
            draft_s = time.perf_counter() - start
            if telemetry.enabled():
                span.set_attributes({
                    "splitspec.step": request.step, "splitspec.sequences": len(request.seqs),
                    "splitspec.tree_nodes": sum(len(t.tokens) for t in trees),
                    "splitspec.errors": sum(bool(t.error) for t in trees),
                    "splitspec.draft_s": draft_s})
        return draft_pb2.DraftReply(step=request.step, trees=trees, draft_s=draft_s)

    def AttachFeatureMemory(self, request: draft_pb2.AttachFeatureMemoryRequest,
                            context: grpc.ServicerContext) -> draft_pb2.AttachFeatureMemoryReply:
        """Whether this process can read the target's segment: it opens it and checks its
        first bytes (each Exchange stream that names it opens it again, for its lifetime)."""
        try:
            memory = FeatureMap(request.path)
        except OSError as exc:  # another host, container or user: the answer says so
            log.warning("cannot read the target's feature memory %s: %s", request.path, exc)
            return draft_pb2.AttachFeatureMemoryReply(error=f"cannot open {request.path}: {exc}")
        try:
            memory.check(request.check)
        except ValueError as exc:
            log.warning("%s", exc)
            return draft_pb2.AttachFeatureMemoryReply(error=str(exc))
        finally:
            memory.close()
        log.info("the target's features come through shared memory %s", request.path)
        return draft_pb2.AttachFeatureMemoryReply()

    def GetInfo(self, request: draft_pb2.GetDraftInfoRequest,
                context: grpc.ServicerContext) -> draft_pb2.DraftInfo:
        return self.info

    def GetStatus(self, request: draft_pb2.GetDraftStatusRequest,
                  context: grpc.ServicerContext) -> draft_pb2.DraftStatus:
        return draft_pb2.DraftStatus(sequences=self.drafter.num_held,
                                     exchanges=self.drafter.num_exchanges,
                                     spec=self.drafter.stats.to_pb(),
                                     trees=self.drafter.num_trees,
                                     replay_misses=self.drafter.num_misses)

    def GetInitReport(self, request: common_pb2.GetInitReportRequest,
                      context: grpc.ServicerContext) -> common_pb2.InitReport:
        return self.report.to_pb()
