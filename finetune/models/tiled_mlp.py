"""The tiled MLP (`tiled_mlp`): a decoder layer's gated MLP applied a tile of positions at a time, each tile
recomputed in the backward, so that only one tile's `tokens × intermediate_size` tensors exist.

A Llama/Qwen/Mistral/Gemma-style MLP is `down(act(gate(x)) * up(x))`, position by position: its gate, up and product
are `intermediate_size` wide (14,336 for Llama 3 8B, 3.5× the hidden size), the largest tensors of a layer at a long
context, kept for its backward (or remade by checkpointing's recomputation, all of them at once). Cut along the
sequence, each tile runs under `torch.utils.checkpoint` (as the chunked loss's chunks do, `finetune.kinds.chunked`),
which keeps only the tile's input (a view of the layer's) and recomputes the tile in the backward under the forward's
autocast and random state. The outputs are the untiled ones (each position's MLP is the same ops); the weights'
gradients are sums over the tiles instead of one matmul's, equal to fp32 rounding. The design is Arctic Long Sequence
Training's TiledMLP (Snowflake/DeepSpeed, 2025), with torch's checkpoint instead of a hand-written autograd function.

The MLP module itself is left in place (its forward is wrapped on the instance), so LoRA's adapters on its
projections, quantized projections, checkpointing and activation offload around the layer, and the state dict's
names are what they are without tiling.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import checkpoint

ATTRIBUTE = "_tiled_mlp"  # where `enable` leaves the tile size on the model
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
COUNTED_TILES = 2  # the planner's dry run computes this many tiles at each end of the sequence (`_tiles`)


def is_gated_mlp(module: Any) -> bool:
    """Whether `module` is a gated MLP applied position by position: gate, up and down projections and an
    activation (LlamaMLP, Qwen2MLP, MistralMLP, GemmaMLP and their kin in transformers)."""
    return isinstance(module, torch.nn.Module) and all(hasattr(module, name) for name in (*PROJECTIONS, "act_fn")) \
        and type(module).__name__.endswith("MLP")


def mlps(model: Any) -> list[Any]:
    """The model's gated MLPs (one per decoder layer)."""
    return [m for m in model.modules() if is_gated_mlp(m)]


MIN_TILE = 512  # the shortest tile the default cuts a sample into: its matmuls are still wide enough
MIN_TILES = 4  # the fewest tiles the default cuts a sample of more than MIN_TILE positions into


def default_tile(model_config: Any, tokens: int | None = None) -> int:
    """Tokens per tile when `tiled_mlp_tile` is not set: the hidden size (ALST's choice), so that one tile's
    intermediate (`tile × intermediate_size`) is the size of one projection's weight, and a tile's matmuls are still
    large enough to run at full speed (4,096 positions for Llama 3 8B). A sample of `tokens` shorter than MIN_TILES
    such tiles is still cut in MIN_TILES (tiles of at least MIN_TILE): where the fixed terms leave little room (an
    8 B model in 8 GiB: a few thousand tokens), the one untiled intermediate would be the largest activation, and a
    tile's work is the same however the sample is cut (each position recomputed once). The tile grows with the
    length and without jumps, so the peak does too (`longest_within` steps along it)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden = int(getattr(text, "hidden_size", 0) or 1024)
    if tokens is None:
        return hidden
    return min(hidden, max(MIN_TILE, -(-tokens // MIN_TILES)))


def resolved_tile(c: Any, model_config: Any, tokens: int | None = None) -> int:
    """The run's tile for samples of up to `tokens`: `tiled_mlp_tile`, or `default_tile`."""
    return c.tiled_mlp_tile or default_tile(model_config, tokens)


def fit_tile(model: Any, c: Any, tokens: int) -> None:
    """Re-tile a tiled `model` (a dry run's skeleton) for samples of `tokens`, where the tile is the default's: the
    tile the plan records for that length (`resolved_tile`)."""
    if c.tiled_mlp_tile is None and (tile := tile_of(model)) is not None:
        wanted = default_tile(model.config, tokens)
        if wanted != tile:
            enable(model, wanted)


def _tiled(forward: Callable[[torch.Tensor], torch.Tensor], tile: int) -> Callable[..., torch.Tensor]:
    """`forward` of a gated MLP or a norm, a tile of `tile` positions (the second-to-last dimension) at a time."""

    @functools.wraps(forward)
    def call(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if x.dim() < 2 or x.size(-2) <= tile or args or kwargs:
            return forward(x, *args, **kwargs)
        if not torch.is_grad_enabled():
            return torch.cat([forward(part) for part in x.split(tile, dim=-2)], dim=-2)
        parts = []
        for part, stand_in in _tiles(x, tile):
            if stand_in:
                parts.append(part.to(parts[-1].dtype) * 1.0)
            else:
                # Non-reentrant: nests inside the decoder layer's own checkpoint, and needs no input that requires
                # grad (a frozen base's first layer under LoRA).
                parts.append(checkpoint(forward, part, use_reentrant=False))
        return torch.cat(parts, dim=-2)

    call.tiled = tile  # type: ignore[attr-defined]
    return call


def _tiles(x: torch.Tensor, tile: int) -> list[tuple[torch.Tensor, bool]]:
    """The input's tiles of `tile` positions, and whether each only stands in for the tiles between the first and
    the last COUNTED_TILES, in a dry run (fake tensors, shapes only: the planner's) that would otherwise compute
    every one of a 300 k-token sample's 75 tiles, three times (forward, the layer's recomputation, the tile's).

    What a middle tile leaves is its output until the concatenation (forward) and its input's gradient until every
    tile's is there (backward); the largest transient, one tile's recomputation, is the same in each, and the peak
    is at the last tile computed, a counted one at either end. One stand-in of the middle tiles' positions (a
    multiplication by one: a new output, a new gradient, nothing saved) leaves the same bytes without their work,
    so the window's peak is what computing every tile gives, to the byte (tests/test_tiled_mlp.py compares the
    two). A real run computes every tile."""
    length = x.size(-2)
    tiles = -(-length // tile)
    if not isinstance(x, FakeTensor) or tiles <= 2 * COUNTED_TILES:
        return [(part, False) for part in x.split(tile, dim=-2)]
    middle = tile * (tiles - 2 * COUNTED_TILES)
    sizes = [tile] * COUNTED_TILES + [middle] + [tile] * (COUNTED_TILES - 1) + [length - tile * (tiles - 1)]
    return [(part, k == COUNTED_TILES) for k, part in enumerate(x.split(sizes, dim=-2))]


def norms(model: Any) -> list[Any]:
    """The model's RMSNorms over the hidden size (each decoder layer's input and post-attention norms, the final
    one), not a per-head norm (Qwen3's `q_norm` over the head dimension)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")
            and getattr(getattr(m, "weight", None), "shape", None) == (hidden,)]


def enable(model: Any, tile: int) -> int:
    """Tile every gated MLP of `model` by `tile` positions, and its RMSNorms over the hidden size with them
    (enabled twice, the last tile size holds); returns how many MLPs were tiled (0: the model has none of this
    shape, and runs as before).

    A norm is position by position too, and upcasts its input to float32 (`tokens × hidden × 4` bytes, kept for
    its backward, which makes as many float32 temporaries again): with the MLP's intermediate cut down, those are
    the largest tensors left of a layer's recomputation at a long context. Tiled, one tile's exist at a time."""
    if tile < 1:
        raise ValueError(f"a tile needs at least one position, not {tile}")
    found = mlps(model)
    for module in (*found, *(norms(model) if found else ())):
        forward = module.forward
        if getattr(forward, "tiled", None) is not None:
            forward = forward.__wrapped__
        module.forward = _tiled(forward, tile)
    if found:
        setattr(model, ATTRIBUTE, tile)
    return len(found)


def tile_of(model: Any) -> int | None:
    """The tile size `enable` put on `model` (through its wrappers), or None when its MLPs are not tiled."""
    for module in (model, *getattr(model, "modules", lambda: [])()):
        if (tile := getattr(module, ATTRIBUTE, None)) is not None:
            return tile
    return None
