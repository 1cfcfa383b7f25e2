"""What moving an EAGLE-3 head's features from the target's cache to the draft's device
costs on this host, way by way, per request and per row (docs/benchmarks.md, thirty-fifth
part).

A draft request carries, for each sequence, the features of every token it sends (3 x the
target's hidden size, 24 KiB a token at the 8B shape in bfloat16): a steady step a few rows
a sequence, a return to speculation everything committed while it was off. Through shared
memory (``splitspec/feature_memory.py``) the features go:

    target: the cache's rows gathered on the device -> host -> the ring (a memfd)
    draft:  the ring -> the head's input on its device (the replay draft: a host copy)

Each way below is timed over requests of SEQS sequences of ROWS rows, their regions
following each other round the ring as a stream's requests do, once the target has written
all of it (``new ring`` below: before). The ways:

- target ``staged``: ``ModelRunner.read_features`` (gather, one copy into a reused pinned
  buffer), then ``FeatureRing.put`` (one copy into the ring): session 39's way, and a
  target's whose ring could not be page-locked;
- target ``direct``: the ring page-locked (``FeatureRing.pin``), room held in it
  (``DraftLink.feature_slot``) and the gathered rows copied from the device straight there
  (``read_features(slots, into)``);
- draft ``replay before``, ``eager before``: what the replay draft and the head's eager
  catch-up did before session 40 (``FeatureMap.read`` returned a copy; the head made a
  tensor of each sequence's, concatenated them and copied that to the device);
- draft ``replay``, ``eager``: what they do now (``FeatureMap.read`` is a view; the replay
  copies it into a reused buffer, the head through ``RowStaging``'s reused pinned one);
- ``new ring``: ``staged`` and ``replay`` on a ring made for the request, as a stream's first
  requests find it (the target's writes allocate its pages, the draft's reads map them);
- draft ``registered``: the draft's read-only mapping registered with CUDA, one copy of the
  request's region to the device (a prototype, not in the package).

    python bench/bench_feature_path.py --seqs 64 --rows 4,65,100 --repeats 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch

from splitspec.feature_memory import CHECK_BYTES, FeatureMap, FeatureRing
from splitspec.kv_cache import KVCache
from splitspec.staging import RowStaging
from target_service.runner import ModelRunner


def registered_view(array: np.ndarray) -> torch.Tensor:
    """A uint8 tensor over ``array`` (the draft's read-only mapping), its pages registered
    with CUDA as read-only (unregister them before the mapping goes)."""
    with warnings.catch_warnings():  # read-only: the tensor is only read from
        warnings.simplefilter("ignore", UserWarning)
        view = torch.from_numpy(array)
    err = torch.cuda.cudart().cudaHostRegister(view.data_ptr(), view.numel(), 8)  # ReadOnly
    if err != torch.cuda.cudart().cudaError.success:
        raise RuntimeError(f"cudaHostRegister failed: {err}")
    return view


def median_ms(fn: Callable[[int], None], repeats: int) -> float:
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        fn(i)
        if i >= 2:  # two untimed
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run(seqs: int, rows: int, width: int, repeats: int, ring_mb: int) -> dict[str, float]:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16
    row_bytes = width * dtype.itemsize
    total = seqs * rows
    nbytes = total * row_bytes
    ring = FeatureRing(ring_mb << 20)
    ring.array[:] = 0  # every page written once, as in a run after its first requests
    view = FeatureMap(ring.path)
    cache = KVCache(1, -(-max(4 * total, 4096) // 16), 16, 1, 8, dtype, device)
    cache.hold_features(width, dtype)
    cache.features.copy_(torch.randn(cache.features.shape, device=device))
    runner = ModelRunner(None, cache, None, device)
    slots = torch.randperm(cache.features.shape[0])[:total].tolist()
    out: dict[str, float] = {}
    placed: list[int] = []  # each request's offset, for the draft's ways

    key = iter(range(1 << 30))  # the requests of the ring's stream, in order

    def put_before(i: int) -> None:  # what a target whose ring is not page-locked does
        rows_ = runner.read_features(slots)
        k = next(key)
        ring.replied(k - 1)
        placed.append(ring.put(rows_.view(torch.uint8).numpy(), k))

    out["target staged"] = median_ms(put_before, repeats)
    if cuda and (error := ring.pin()):
        raise RuntimeError(error)

    def put_direct(i: int) -> None:  # DraftLink.feature_slot, then read_features into it
        k = next(key)
        ring.replied(k - 1)
        start = ring.reserve(nbytes, k)
        runner.read_features(slots, ring.array[start:start + nbytes])
        placed.append(start)

    out["target direct"] = median_ms(put_direct, repeats)
    offsets = placed[-repeats:]
    per_seq = rows * row_bytes

    def regions(i: int) -> list[tuple[int, int]]:
        base = offsets[i % len(offsets)]
        return [(base + s * per_seq, per_seq) for s in range(seqs)]

    def replay_before(i: int) -> None:  # session 39's: FeatureMap.read copied, then again
        for offset, length in regions(i):
            bytearray(bytes(view.read(offset, length)))

    def eager_before(i: int) -> None:  # session 39's head: a tensor a sequence, cat, copy
        feats = [torch.frombuffer(bytearray(bytes(view.read(o, n))), dtype=torch.uint8)
                 for o, n in regions(i)]
        torch.cat(feats).to(device)
        if cuda:
            torch.cuda.synchronize()

    host = np.empty(nbytes, dtype=np.uint8)

    def replay(i: int) -> None:  # ReplayDrafter._copy: each view into a reused buffer
        at = 0
        for offset, length in regions(i):
            host[at:at + length] = view.read(offset, length)
            at += length

    staging = RowStaging(device)

    def eager(i: int) -> None:  # Drafter._features: RowStaging
        staging.send([view.read(offset, length) for offset, length in regions(i)])
        if cuda:
            torch.cuda.synchronize()

    for name, fn in [("draft replay before", replay_before), ("draft eager before", eager_before),
                     ("draft replay", replay), ("draft eager", eager)]:
        out[name] = median_ms(fn, repeats)
    fresh: list[tuple[FeatureRing, FeatureMap]] = []

    staged = runner.read_features(slots).view(torch.uint8).numpy()

    def put_fresh(i: int) -> None:  # a stream's first requests: the ring's pages are new
        ring_ = FeatureRing(CHECK_BYTES + nbytes)
        fresh.append((ring_, FeatureMap(ring_.path)))
        ring_.put(staged, 0)

    def replay_fresh(i: int) -> None:  # ... and not yet mapped by the draft
        view_ = fresh[i][1]
        at = 0
        for s in range(seqs):
            host[at:at + per_seq] = view_.read(CHECK_BYTES + s * per_seq, per_seq)
            at += per_seq

    out["target staged, new ring"] = median_ms(put_fresh, repeats)
    out["draft replay, new ring"] = median_ms(replay_fresh, repeats)
    for ring_, view_ in fresh:
        view_.close()
        ring_.close()
    if cuda:
        seen = registered_view(view._bytes)
        device_rows = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def registered(i: int) -> None:
            base = offsets[i % len(offsets)]
            device_rows.copy_(seen[base:base + nbytes], non_blocking=True)
            torch.cuda.synchronize()

        out["draft registered"] = median_ms(registered, repeats)
        torch.cuda.cudart().cudaHostUnregister(seen.data_ptr())
    ring.close()
    view.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="64", help="sequences a request, comma-separated")
    parser.add_argument("--rows", default="4,65,100", help="rows a sequence, comma-separated")
    parser.add_argument("--width", type=int, default=3 * 4096, help="features a row (bfloat16)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--ring-mb", type=int, default=256)
    parser.add_argument("--json", default="", help="write the results here too")
    args = parser.parse_args()
    results = []
    for seqs in map(int, args.seqs.split(",")):
        for rows in map(int, args.rows.split(",")):
            costs = run(seqs, rows, args.width, args.repeats, args.ring_mb)
            total = seqs * rows
            print(f"{seqs} sequences x {rows} rows ({total * args.width * 2 / 2**20:.1f} MiB):")
            for name, ms in costs.items():
                print(f"  {name:18s} {ms:8.3f} ms  {1e3 * ms / total:7.2f} us a row")
            results.append({"seqs": seqs, "rows": rows, "ms": costs})
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"width": args.width, "repeats": args.repeats, "results": results}, file,
                      indent=1)


if __name__ == "__main__":
    main()
