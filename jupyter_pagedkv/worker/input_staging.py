"""InputStaging: a step's integer inputs reach the device in one copy, into buffers that persist.

The Triton path reads token ids, positions, the slot mapping, query start locations, sequence
lengths, block tables and the rows to sample. Built as separate tensors they cost one host -> device
copy each (about ten a step) and fresh device allocations, and CUDA graphs need fixed addresses
anyway. Here a step writes every field into one host buffer of int32 words (pinned on CUDA; int64
fields start at even offsets and are viewed as int64), one non-blocking copy moves the used prefix
into a device buffer of the same layout, and the fields are views of it.

The buffers grow (to the next power of two) when a step needs more words, which moves the device
fields; a fixed `capacity` (what a captured graph's buffers need) never grows. Before the host
buffer is written again, the previous copy is waited for: a non-blocking copy reads pinned memory
after the host call returns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np
import torch

_WORDS = {torch.int32: 1, torch.int64: 2}


@dataclass(frozen=True, slots=True)
class Field:
    """One named input: `shape` of `dtype` (int32 or int64), laid at word `offset`."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int = 0

    @property
    def words(self) -> int:
        return math.prod(self.shape) * _WORDS[self.dtype]


def layout(fields: Seq[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[list[Field], int]:
    """Offsets for `fields` in order, int64 ones at even words; returns them and the words used."""
    out, at = [], 0
    for name, dtype, shape in fields:
        if dtype not in _WORDS:
            raise TypeError(f"staged inputs are int32 or int64, not {dtype} ({name})")
        at += at % _WORDS[dtype]
        f = Field(name, dtype, tuple(shape), at)
        out.append(f)
        at += f.words
    return out, at


class InputStaging:
    """A pinned host buffer and a device buffer of int32 words, written and uploaded once a step."""

    def __init__(self, device: torch.device | str, capacity: int | None = None) -> None:
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self.fixed = capacity is not None
        self.num_uploads = 0              # host -> device copies made (one per step)
        self._uploaded: torch.cuda.Event | None = None
        self._allocate(capacity or 4096)

    def _allocate(self, words: int) -> None:
        words += words % 2
        self.host = torch.zeros(words, dtype=torch.int32, pin_memory=self.pin)  # host: the staging side
        self.device_words = torch.zeros(words, dtype=torch.int32, device=self.device)
        self._np = self.host.numpy()

    def fill(self, fields: Seq[tuple[str, torch.dtype, tuple[int, ...]]], values: dict) -> dict[str, torch.Tensor]:
        """Write `values[name]` (a flat sequence, or a list of rows for a 2-D field whose rows are
        zero-padded) into each field, upload the used words in one copy, and return the device
        views by name."""
        placed, used = layout(fields)
        if used > self.host.numel():
            if self.fixed:
                raise ValueError(f"inputs need {used} words, more than this staging's fixed {self.host.numel()}")
            self._wait()
            self._allocate(1 << (used - 1).bit_length())
        self._wait()
        for f in placed:
            _write(self._field_array(f), values[f.name], f)
        self.device_words[:used].copy_(self.host[:used], non_blocking=self.pin)
        self.num_uploads += 1
        if self.pin:
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        return {f.name: self._view(f) for f in placed}

    def views(self, fields: Seq[tuple[str, torch.dtype, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """The device views of `fields` as `fill` lays them out, without writing anything."""
        placed, used = layout(fields)
        if used > self.device_words.numel():
            raise ValueError(f"inputs need {used} words, more than this staging's {self.device_words.numel()}")
        return {f.name: self._view(f) for f in placed}

    def _wait(self) -> None:
        if self._uploaded is not None:
            self._uploaded.synchronize()
            self._uploaded = None

    def _field_array(self, f: Field) -> np.ndarray:
        flat = self._np[f.offset:f.offset + f.words]
        return (flat.view(np.int64) if f.dtype == torch.int64 else flat).reshape(f.shape)

    def _view(self, f: Field) -> torch.Tensor:
        flat = self.device_words[f.offset:f.offset + f.words]
        return (flat.view(torch.int64) if f.dtype == torch.int64 else flat).view(f.shape)


def _write(dst: np.ndarray, value, f: Field) -> None:
    """A flat sequence fills the field; rows (lists) fill a 2-D field zero-padded; a 2-D array of
    [n, w] fills `dst[:n, :w]` and leaves the rest as it was."""
    if isinstance(value, np.ndarray) and value.ndim == 2:
        dst[:value.shape[0], :value.shape[1]] = value
    elif (len(f.shape) == 2 and isinstance(value, (list, tuple)) and value
          and isinstance(value[0], (list, tuple, np.ndarray))):
        dst.fill(0)
        for i, row in enumerate(value):
            dst[i, :len(row)] = row
    else:
        dst.reshape(-1)[:] = np.asarray(value, dtype=dst.dtype).reshape(-1)
