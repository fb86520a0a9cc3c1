"""A decode step's small inputs staged in one host buffer (pinned on a GPU) and sent in one copy.

Five per-step columns (token ids, positions, KV slots, request indices, sequence lengths) would each be a
host tensor and a host-to-device copy; here they are written into one host buffer and the whole buffer (a few
KiB: ``rows`` of each column) goes to its device twin with one ``non_blocking`` copy. Rows past the live batch
hold the padding request's values, so a graph captured for more rows computes harmless rows without more copies.
"""

from typing import Dict, Sequence

import torch

# int64 columns first so every column's view stays aligned to its element size.
FIELDS = (
    ("input_ids", torch.int64),
    ("positions", torch.int64),
    ("out_token_idx", torch.int64),
    ("b_req_idx", torch.int32),
    ("b_seq_len", torch.int32),
)


class DecodeStaging:
    """``rows`` rows of every column of :data:`FIELDS`, on the host and on ``device``.

    ``device_views[name]`` are the static device tensors (what a decode graph captures); :meth:`stage` writes one
    step's columns and copies the whole buffer. ``pad`` gives each column's value for rows past the batch.
    """

    def __init__(self, rows: int, device: torch.device, pad: Dict[str, int]):
        if set(pad) != {name for name, _ in FIELDS}:
            raise ValueError(f"DecodeStaging: pad expected a value for each of {[n for n, _ in FIELDS]}, got "
                             f"{sorted(pad)}")  # fmt: skip
        self.rows, self.pad = rows, pad
        pinned = device.type == "cuda"
        nbytes = sum(rows * dtype.itemsize for _, dtype in FIELDS)
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._host_columns, self.device_views, start = {}, {}, 0
        for name, dtype in FIELDS:
            end = start + rows * dtype.itemsize
            self._host_columns[name] = self.host[start:end].view(dtype).numpy()
            self.device_views[name] = self.device_buffer[start:end].view(dtype)
            start = end
        for name, column in self._host_columns.items():
            column[:] = pad[name]
        self._live = 0  # rows holding the last step's values
        # The last copy must have read the host buffer before it is written again.
        self._copied = torch.cuda.Event() if pinned else None
        self.device_buffer.copy_(self.host)

    def stage(self, **columns: Sequence[int]) -> None:
        """Write one step's columns (each ``batch`` long) into rows ``[0, batch)``, pad the rest, copy to the
        device (``non_blocking``: ordered on the current stream before the step's kernels)."""
        batch = len(columns["input_ids"])
        if set(columns) != set(self._host_columns) or any(len(v) != batch for v in columns.values()):
            raise ValueError(f"DecodeStaging.stage: expected {sorted(self._host_columns)} of one length, got "
                             f"{ {name: len(v) for name, v in columns.items()} }")  # fmt: skip
        if batch > self.rows:
            raise ValueError(f"DecodeStaging.stage: batch expected at most {self.rows} rows, got {batch}")
        if self._copied is not None:
            self._copied.synchronize()
        for name, values in columns.items():
            column = self._host_columns[name]
            column[:batch] = values.numpy() if isinstance(values, torch.Tensor) else values
            if self._live > batch:
                column[batch : self._live] = self.pad[name]
        self._live = batch
        self.device_buffer.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def write_table(self, req_to_token: torch.Tensor, batch: int) -> None:
        """``req_to_token[b_req_idx[i], positions[i]] = out_token_idx[i]`` for the first ``batch`` staged rows, on
        the device from the staged copy: a step's new KV slots enter the table with no transfer of their own."""
        v = self.device_views
        rows, cols = v["b_req_idx"][:batch].long(), v["positions"][:batch]
        req_to_token[rows, cols] = v["out_token_idx"][:batch].to(req_to_token.dtype)
