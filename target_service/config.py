"""Target service configuration (flags are generated from these fields)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from splitspec.builtin import BUILTIN_TARGET
from splitspec.config_args import option
from splitspec.model.loader import CPU_THREADS_HELP, DEFAULT_CPU_THREADS
from splitspec.tree import SMALL_CHAIN


@dataclass(frozen=True)
class TargetConfig:
    model: Path = option(BUILTIN_TARGET, "target checkpoint folder (config.json, *.safetensors, tokenizer.json)")
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(50052, "gRPC port")
    draft: str = option("", "draft service address host:port; empty = no speculation")
    dtype: str = option("float32", "weights and activations dtype", ("float32", "bfloat16", "float16"))
    device: str = option("cpu", "torch device (cpu, cuda, cuda:1, ...)")
    cpu_threads: int = option(DEFAULT_CPU_THREADS, CPU_THREADS_HELP)
    tp: int = option(1, "tensor-parallel ranks (processes; one GPU each with --device cuda); "
                     "under torchrun the world size")
    dist_timeout_s: float = option(600.0, "timeout of the ranks' collectives (a dead rank is "
                                   "noticed by rank 0's watcher long before)")
    attention_backend: str = option("auto", "attention backend; auto = flashinfer on CUDA in "
                                    "bfloat16/float16 when it is installed, else torch",
                                    ("auto", "torch", "flashinfer"))
    cuda_graphs: bool = option(True, "capture CUDA graphs of decode and (with a draft) "
                               "tree-verify steps for batch sizes up to --max-running, and of "
                               "prefills up to --prefill-graph-tokens (CUDA with the "
                               "flashinfer backend, one rank)")
    prefill_graph_tokens: int = option(512, "prompt tokens of a step up to which its prefill "
                                       "replays a CUDA graph (0: prompts always run eagerly)")
    graph_tree_sizes: str = option("", "tree sizes (nodes, comma-separated) whose verify steps "
                                   "replay CUDA graphs; empty = --num-draft-tokens and 3 (the "
                                   "small budget of the gateway's adaptive policy). A size "
                                   "the gateway asks for without a graph is verified eagerly "
                                   "(slower, the same tokens)")
    max_running: int = option(32, "sequences decoded at once")
    max_context: int = option(1024, "prompt + generated tokens per sequence")
    page_size: int = option(16, "KV-cache page size in tokens")
    num_pages: int = option(0, "KV-cache pages; 0 = enough for max_running full sequences")
    max_prefill_tokens: int = option(4096, "prompt tokens prefilled in one step")
    num_draft_tokens: int = option(8, "default tree size (nodes, root excluded) when speculating")
    topk: int = option(4, "default tree branching (1 = chain)")
    num_steps: int = option(4, "default tree depth")
    early_exchange: bool = option(False, "send each step's draft request at the end of the "
                                  "step before, so the exchange runs while that step's tokens "
                                  "are emitted (the same tokens either way; off: on 2 CPU "
                                  "cores the overlap slowed the draft more than it saved, and "
                                  "on an H200 at 8-32 streams sending it early cost the "
                                  "target's thread what it saved of the draft wait, "
                                  "docs/benchmarks.md)")
    defer_catch_up: int = option(0, "tokens: when speculation returns after plain decoding "
                                 "(a policy's change, a draft that was away) and a sequence "
                                 "generated more than this many tokens the draft has not seen, "
                                 "the steps go on without speculation while the draft catches "
                                 "up, instead of one step waiting for it (the same tokens "
                                 "either way). 0 = the step waits")
    drain_timeout_s: float = option(25.0, "on SIGTERM / SIGINT: seconds to let the requests in "
                                    "flight finish (health NOT_SERVING; new requests are "
                                    "refused, and the gateway answers them UNAVAILABLE) before "
                                    "stopping; a second signal stops at once")
    feature_memory_mb: int = option(256, "shared memory for an EAGLE-3 draft's features, "
                                    "used when the draft can read it (on this host): they "
                                    "then need not travel on the draft stream; a request "
                                    "whose features do not fit sends them on the stream. "
                                    "0 = always on the stream")
    feature_memory_dir: str = option("", "make that shared memory as a file in this directory "
                                     "(its name removed once the draft has opened it), for a "
                                     "draft that sees the directory at the same path but not "
                                     "this process: a tmpfs volume mounted in both containers. "
                                     "Default: an anonymous memfd, which only a draft in this "
                                     "container can open")
    exchange_memory: bool = option(True, "send each draft stream's requests after its first, "
                                   "and take their replies, through a mailbox in shared memory "
                                   "that both sides poll, when the draft can map it (on this "
                                   "host, or in a container that sees --feature-memory-dir; "
                                   "x86-64 only), else on the stream: at batch 1 on an H100 "
                                   "host it took 0.5-0.8 ms off an 8.6 ms step (the stream's "
                                   "thread wake-ups), docs/benchmarks.md, forty-third part")
    draft_timeout_s: float = option(2.0, "deadline of one draft exchange; past it the step decodes plainly")
    connect_timeout_s: float = option(120.0, "how long connect_draft waits for the draft to be SERVING")
    init_report: Path | None = option(None, "also write the JSON init report to this file")
    profile_out: Path | None = option(None, "profile the engine thread (every step it runs, "
                                      "with cProfile) and write the statistics to this file "
                                      "when the target stops; read them with python -m pstats. "
                                      "Profiling slows the steps: for finding where a step's "
                                      "host time goes, not for serving. From Python 3.12 "
                                      "cProfile sees every thread of the process once it is "
                                      "on (sys.monitoring), so the gRPC threads' calls are "
                                      "mixed in")
    log_level: str = option("INFO", "logging level")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def verify_graph_sizes(self) -> tuple[int, ...]:
        """The tree sizes of --graph-tree-sizes, ascending (ValueError says what is wrong)."""
        text = self.graph_tree_sizes.strip()
        if not text:
            return tuple(sorted({self.num_draft_tokens, SMALL_CHAIN}))
        parts = [part.strip() for part in text.split(",")]
        if not all(part.isdigit() for part in parts):
            raise ValueError(f"--graph-tree-sizes {text!r} is not comma-separated node "
                             "counts, e.g. 2,8")
        sizes = sorted({int(part) for part in parts})
        if sizes[0] < 1 or sizes[-1] > self.max_tree_nodes:
            raise ValueError(f"--graph-tree-sizes {text!r}: each size must be 1 to "
                             f"{self.max_tree_nodes} nodes")
        return tuple(sizes)

    @property
    def max_tree_nodes(self) -> int:
        """The largest tree a step may verify (the policy cannot ask for more)."""
        return max(self.num_draft_tokens, 64)
