"""Training the models SplitSpec serves: data, causal LMs, EAGLE-3 heads, the whole pipeline.

- ``data``: a code corpus (standard library, site-packages or a folder), its train / held-out
  split by file, the byte-level BPE tokenizer, packing into blocks, held-out prompts.
- ``lm``: Llama causal LMs from scratch (next-token loss) and distilled from a teacher
  (standalone drafts), through one training loop; perplexity, argmax agreement, saving.
- ``eagle3``: EAGLE-3 heads trained on a target's features with the training-time-test loss.
- ``pipeline``: ``python -m splitspec.training.pipeline``: corpus -> tokenizer -> target ->
  EAGLE-3 head -> standalone draft -> held-out evaluation -> files and manifest.
- ``files``: JSON, sha256 digests and library versions for manifests.
"""
