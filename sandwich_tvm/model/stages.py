"""Pipeline stages in the model file: which consecutive layers a stage owns and what it takes
and gives.

A model split into ``count`` stages runs stage ``index``'s layers ``[first_layer,
end_layer)``. The first stage also embeds the tokens and holds the head (the final norm and the
logits, a tied embedding's one copy): the last stage hands the hidden states of the positions
asked for back to it, as the cache-resident paper's serving socket does, so that only hidden
states cross between stages and the logits are made where the controller samples them (on the
controller's host when the stages span hosts). Every stage takes and gives the hidden states of
every token (``[1, tokens, hidden]`` in a prefill chunk, ``[batch, 1, hidden]`` in a decode
step). Parameters keep the whole model's names (``model.layers.{global index}``), so every
stage loads from the same checkpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MIN_PIECE = 16  # tokens: the runtime splits one prompt chunk into pieces of at least this many


@dataclass(frozen=True)
class Stage:
    """Stage ``index`` of ``count``: layers ``[first_layer, end_layer)``."""

    index: int
    count: int
    first_layer: int
    end_layer: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @property
    def layers(self) -> int:
        return self.end_layer - self.first_layer

    def global_name(self, name: str) -> str:
        """A parameter's name in the whole model (the stage's layer ``i`` is layer
        ``first_layer + i``)."""
        return re.sub(r"^model\.layers\.(\d+)\.", lambda m: f"model.layers.{int(m[1]) + self.first_layer}.",
                      name)

    def to_json(self) -> dict:
        return {"index": self.index, "count": self.count, "first_layer": self.first_layer,
                "end_layer": self.end_layer}


def split_layers(num_layers: int, count: int) -> list[Stage]:
    """``count`` stages of consecutive layers, as even as possible; a remainder goes to the
    later stages (the first one also runs the embedding and the head)."""
    if not 1 <= count <= num_layers:
        raise ValueError(f"a model of {num_layers} layers splits into 1 to {num_layers} pipeline stages, "
                         f"not {count}")
    base, extra = divmod(num_layers, count)
    stages, start = [], 0
    for i in range(count):
        n = base + (i >= count - extra)
        stages.append(Stage(i, count, start, start + n))
        start += n
    return stages
