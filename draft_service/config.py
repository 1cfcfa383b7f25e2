"""Draft service configuration (flags are generated from these fields)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draft_service.models import REPLAY
from splitspec.builtin import BUILTIN_EAGLE3, BUILTIN_TARGET
from splitspec.config_args import option
from splitspec.model.loader import CPU_THREADS_HELP, DEFAULT_CPU_THREADS

KINDS = ("auto", "eagle3", "standalone", REPLAY)


@dataclass(frozen=True)
class DraftConfig:
    model: Path = option(BUILTIN_EAGLE3, "draft checkpoint folder: an EAGLE-3 head or a small "
                         "Llama causal LM (config.json, *.safetensors); not used by --kind replay")
    kind: str = option("auto", "draft kind; auto = eagle3 when config.json's architectures is "
                       "an EAGLE-3 head, else standalone; replay = the benchmark draft that "
                       "replays --replay-file (needs --target-model)", KINDS)
    target_model: str = option("", "target checkpoint folder: gives an EAGLE-3 head without "
                               "embed_tokens its embedding, the target's layer count, and the "
                               "tokenizer fingerprint when the draft folder has no tokenizer.json; "
                               "empty = the built-in target when --model is the built-in head, "
                               "else none")
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(50053, "gRPC port")
    dtype: str = option("float32", "weights and activations dtype", ("float32", "bfloat16", "float16"))
    device: str = option("cpu", "torch device (cpu, cuda, cuda:1, ...)")
    quantize: str = option("none", "fp8 = the projections' weights also in fp8 (e4m3, a scale "
                           "per output row), used where 1 to 64 rows pass (the tree levels; "
                           "on CUDA, multiplied in float16, so an activation beyond 65504 "
                           "spoils its row's draft): half the bytes read, a slightly "
                           "different draft (the output is still the target's; acceptance "
                           "may fall); on CPU slower, for checking acceptance; none = as "
                           "loaded", ("none", "fp8"))
    cpu_threads: int = option(DEFAULT_CPU_THREADS, CPU_THREADS_HELP)
    attention_backend: str = option("auto", "attention backend; auto = flashinfer on CUDA in "
                                    "bfloat16/float16 when it is installed, else torch",
                                    ("auto", "torch", "flashinfer"))
    max_running: int = option(64, "sequences held at once (over all streams); sizes the KV cache")
    max_context: int = option(1024, "longest sequence (committed tokens) the draft holds")
    page_size: int = option(16, "KV-cache page size in tokens")
    max_tree_nodes: int = option(64, "largest tree drafted (nodes, root excluded); larger "
                                 "requests are capped")
    sampled_trees: bool = option(False, "for requests that sample (temperature > 0), draw each "
                                 "tree node's children from the draft's own distribution under "
                                 "the request's temperature/top-k/top-p and send it with the "
                                 "tree (the target verifies by rejection sampling); off = top-k "
                                 "trees for every request")
    proposal_support: int = option(64, "with --sampled-trees: tokens kept in each node's "
                                   "distribution (the most likely ones, renormalised)")
    replay_file: Path | None = option(None, "--kind replay: the target's recorded greedy "
                                      "continuations, JSON lines of {\"prompt\": [ids], "
                                      "\"tokens\": [ids]} (python -m splitspec.replay "
                                      "records them)")
    replay_corrupt_rate: float = option(0.0, "--kind replay: chance that a tree node on the "
                                        "recorded path carries a wrong token instead (0 = "
                                        "every drafted path is the target's, 1 = none)")
    replay_features: bool = option(False, "--kind replay: take an EAGLE-3 head's features "
                                   "(the target's default three layer inputs) with every "
                                   "request and copy them once on the host, as an EAGLE-3 draft "
                                   "does, so the exchange carries what it would with a head of "
                                   "the target's shape; the trees do not use them")
    replay_cost_model: Path | None = option(None, "--kind replay: a draft model folder (an "
                                            "EAGLE-3 head or a small Llama; random weights "
                                            "will do) run on every request as a draft of its "
                                            "kind runs (catch-up, then the tree search of the "
                                            "shape asked) and its trees thrown away, so the "
                                            "draft's time is that model's while the trees stay "
                                            "the replay's; an EAGLE-3 head has the target send "
                                            "it its features (so not with --replay-features); "
                                            "--quantize applies to it")
    graph_trees: str = option("4x4", "tree shapes (TOPKxDEPTH, comma-separated) whose drafting is "
                              "captured as CUDA graphs, per batch-size bucket up to --max-running "
                              "(CUDA with flashinfer); other shapes draft eagerly; '' = none")
    init_report: Path | None = option(None, "also write the JSON init report to this file")
    log_level: str = option("INFO", "logging level")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def target_dir(self) -> Path | None:
        """The target checkpoint, when one is given or implied by the built-in head."""
        if self.target_model:
            return Path(self.target_model)
        if Path(self.model).resolve() == BUILTIN_EAGLE3.resolve():
            return BUILTIN_TARGET
        return None

    @property
    def scratch_slots(self) -> int:
        """KV slots per sequence kept free for a tree's frontier nodes (beyond the context)."""
        return self.max_tree_nodes

    @property
    def num_pages(self) -> int:
        """Pages for max_running sequences of max_context tokens, each with tree scratch room."""
        per_seq = -(-(self.max_context + self.scratch_slots) // self.page_size)
        return self.max_running * per_seq

    @property
    def graph_shapes(self) -> list[tuple[int, int]]:
        """--graph-trees as (topk, depth) pairs; ValueError says what is wrong."""
        shapes = []
        for item in filter(None, (part.strip() for part in self.graph_trees.split(","))):
            topk, sep, depth = item.partition("x")
            if not (sep and topk.isdigit() and depth.isdigit() and int(topk) > 0 and int(depth) > 0):
                raise ValueError(f"--graph-trees entry {item!r} is not TOPKxDEPTH (e.g. 4x4)")
            shapes.append((int(topk), int(depth)))
        return shapes

    def check(self) -> None:
        """Raise ValueError naming the flag to change when a value cannot work."""
        for flag, value in (("--max-running", self.max_running), ("--max-context", self.max_context),
                            ("--page-size", self.page_size),
                            ("--max-tree-nodes", self.max_tree_nodes),
                            ("--proposal-support", self.proposal_support)):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        self.graph_shapes  # noqa: B018 - raises on a malformed --graph-trees
        if self.quantize != "none" and self.kind == REPLAY and self.replay_cost_model is None:
            raise ValueError(f"--quantize {self.quantize}: the replay draft has no weights (but "
                             "its --replay-cost-model has)")
        if self.quantize != "none" and self.device.startswith("cuda") and self.dtype == "float32":
            raise ValueError(f"--quantize {self.quantize} on CUDA needs --dtype bfloat16 or "
                             "float16 (its kernel multiplies 2-byte activations)")
        if self.kind == REPLAY:
            self.check_replay()
        elif (self.replay_file is not None or self.replay_features
              or self.replay_cost_model is not None):
            flag = ("--replay-file" if self.replay_file is not None else
                    "--replay-features" if self.replay_features else "--replay-cost-model")
            raise ValueError(f"{flag} is only read by --kind replay, not --kind {self.kind}")
        elif not Path(self.model).is_dir():
            raise FileNotFoundError(f"--model {self.model} is not a folder")
        if self.target_model and not Path(self.target_model).is_dir():
            raise FileNotFoundError(f"--target-model {self.target_model} is not a folder")

    def check_replay(self) -> None:
        """The replay draft's flags (it reads no --model)."""
        if self.replay_file is None:
            raise ValueError("--kind replay needs --replay-file <records file> (record the "
                             "target's continuations with python -m splitspec.replay)")
        if not Path(self.replay_file).is_file():
            raise FileNotFoundError(f"--replay-file {self.replay_file} is not a file")
        if not self.target_model:
            raise ValueError("--kind replay needs --target-model <target checkpoint folder>: it "
                             "gives the vocabulary and the tokenizer fingerprint")
        if not 0 <= self.replay_corrupt_rate <= 1:  # NaN fails too
            raise ValueError(f"--replay-corrupt-rate must be in [0, 1], got "
                             f"{self.replay_corrupt_rate}")
        if self.replay_cost_model is not None and not Path(self.replay_cost_model).is_dir():
            raise FileNotFoundError(f"--replay-cost-model {self.replay_cost_model} is not a "
                                    "folder")
        if self.replay_cost_model is not None and self.replay_features:
            raise ValueError("--replay-features and --replay-cost-model: an EAGLE-3 head as the "
                             "cost model asks for its features itself (drop --replay-features)")
        if self.sampled_trees:
            raise ValueError("--sampled-trees does not apply to --kind replay: its trees are "
                             "deterministic (drop --sampled-trees)")
