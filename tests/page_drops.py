"""Recording which ranges of a mapped GGUF file the loader hands to the page dropper (model_loader/gguf_quant.py)."""

from __future__ import annotations


def recording_page_drops(monkeypatch) -> tuple[dict[str, tuple[int, int]], set[tuple[int, int]]]:
    """(each block tensor's (address, bytes) in the mapped file, by name; the ranges handed to the page dropper),
    filled as the GGUF blocks are attached (model_loader/gguf_quant.py), the pages still dropped."""
    from sglang.srt.model_loader import gguf_quant

    real = gguf_quant.mapped_page_dropper
    ranges: dict[str, tuple[int, int]] = {}
    dropped: set[tuple[int, int]] = set()

    def recording(tensors):
        ranges.update({name: (a.ctypes.data, a.nbytes) for name, (_, a, _, _) in tensors.items()})
        drop = real(tensors)

        def each(address: int, nbytes: int) -> None:
            dropped.add((address, nbytes))
            drop(address, nbytes)

        return each

    monkeypatch.setattr(gguf_quant, "mapped_page_dropper", recording)
    return ranges, dropped
