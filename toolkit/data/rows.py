"""A torch Dataset over rows of equally long tensors (per-user sequences, per-window samples, per-cell features).

    data = TensorRows({"x": inputs, "y": targets}, rows=train_rows, index_name="window")
    data[0] == {"window": train_rows[0], "x": inputs[train_rows[0]], "y": targets[train_rows[0]]}

Every value of an item is a tensor, so the default collate stacks a batch, and the batch carries the row
indices (to look up per-row tables such as a user's history on the device).
"""

from __future__ import annotations

import torch


class TensorRows(torch.utils.data.Dataset):
    """Item i = {index_name: rows[i], **{name: field[rows[i]]}}; rows defaults to every row (0..N-1).

    fields: a non-empty dict of tensors sharing their first dimension N. rows: 1-D integer row numbers in 0..N-1
    (repeats allowed; any order). index_name: the key of the row number in each item; not a field name.
    """

    def __init__(self, fields: dict[str, torch.Tensor], rows: torch.Tensor | None = None, index_name: str = "index"):
        sizes = {name: len(value) for name, value in fields.items()}
        if not fields or len(set(sizes.values())) != 1:
            raise ValueError(f"fields must be non-empty and equally long, got sizes {sizes}")
        if index_name in fields:
            raise ValueError(f"{index_name!r} is added by {type(self).__name__}; do not pass it as a field")
        self.fields = dict(fields)
        self.index_name = index_name
        self.num_rows = next(iter(sizes.values()))
        if rows is None:
            self.rows = torch.arange(self.num_rows)
        else:
            rows = torch.as_tensor(rows)
            if rows.is_floating_point() or rows.is_complex() or rows.dtype == torch.bool:
                raise ValueError(f"rows must be integer row numbers, got dtype {rows.dtype}")
            self.rows = rows.to(torch.long).flatten()
        if len(self.rows) and (self.rows.min() < 0 or self.rows.max() >= self.num_rows):
            raise ValueError(f"rows must be in 0..{self.num_rows - 1}")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[index]
        return {self.index_name: row, **{name: value[row] for name, value in self.fields.items()}}

    # toolkit.run.device_data: batches cut on the device
    def device_bytes(self) -> int:
        """Every field's rows, gathered."""
        return sum(field[0].numel() * field.element_size() * len(self.rows) for field in self.fields.values())

    def on_device(self, device: torch.device):
        """Every field's rows gathered on `device` once; the returned cut(positions) is the collated batch of
        items at those positions (a 1-D index tensor on the device)."""
        columns = {self.index_name: self.rows.to(device),
                   **{name: field[self.rows].to(device) for name, field in self.fields.items()}}
        return lambda positions: {name: column[positions] for name, column in columns.items()}
