"""Draft service configuration (flags are generated from these fields)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from splitspec.builtin import BUILTIN_EAGLE3, BUILTIN_TARGET
from splitspec.config_args import option

KINDS = ("auto", "eagle3", "standalone")


@dataclass(frozen=True)
class DraftConfig:
    model: Path = option(BUILTIN_EAGLE3, "draft checkpoint folder: an EAGLE-3 head or a small "
                         "Llama causal LM (config.json, *.safetensors)")
    kind: str = option("auto", "draft kind; auto = eagle3 when config.json's architectures is "
                       "an EAGLE-3 head, else standalone", KINDS)
    target_model: str = option("", "target checkpoint folder: gives an EAGLE-3 head without "
                               "embed_tokens its embedding, the target's layer count, and the "
                               "tokenizer fingerprint when the draft folder has no tokenizer.json; "
                               "empty = the built-in target when --model is the built-in head, "
                               "else none")
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(50053, "gRPC port")
    dtype: str = option("float32", "weights and activations dtype", ("float32", "bfloat16", "float16"))
    device: str = option("cpu", "torch device (cpu, cuda, cuda:1, ...)")
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

    def check(self) -> None:
        """Raise ValueError naming the flag to change when a value cannot work."""
        for flag, value in (("--max-running", self.max_running), ("--max-context", self.max_context),
                            ("--page-size", self.page_size),
                            ("--max-tree-nodes", self.max_tree_nodes),
                            ("--proposal-support", self.proposal_support)):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if not Path(self.model).is_dir():
            raise FileNotFoundError(f"--model {self.model} is not a folder")
        if self.target_model and not Path(self.target_model).is_dir():
            raise FileNotFoundError(f"--target-model {self.target_model} is not a folder")
