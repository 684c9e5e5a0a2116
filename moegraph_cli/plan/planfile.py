"""The plan file `moegraph plan --out` writes and `moegraph capture --plan` follows.

    moegraph_plan: 1
    key: {profile, batch, seq_len, dtype, moe_mode, capacity_factor, model_hash, world, ep}
    pool: shared                    # strategy: shared | per_scope | per_entry
    budget: B    predicted_peak: B    static_bytes: B    eager_peak: B    pool_bytes: B
    pools: {shared: B}              # predicted bytes per pool, named as GraphSession.pools()
    layers:
    - {layer: 0, scopes: [attn, moe], pool: shared,
       groups: {layers.0.attn: shared, layers.0.moe: shared}, predicted_bytes: B,
       recompute: {attn: full, moe: fc1}}   # optional; absent or {}: none
    left_out: ["moe on layers 6-11: ..."]
    loss_chunk: 4096                # optional; rows a chunk of the loss-only head, 0: whole

`groups` maps a model scope name (layers.N.attn, layers.N.moe or layers.N.mlp) to its pool
group; null means private pools (per_entry), whose pools are named `<scope>.fwd` / `.bwd`.
A plan is refused for any other run: the key's batch, seq_len, dtype, MoE mode and model
config hash must match the run's (the profile name may differ, e.g. a checkpoint directory),
and so must its ranks: `world` processes with `ep`-way expert parallelism (a plan predicts one
rank of that layout; a key without them, written before distributed runs, is one process).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..config import Profile
from ..io.documents import at, check_format, is_bytes, is_int, plain, read_document, show
from ..errors import UsageError
from ..config.run import SCOPE_MODES
from .runkey import check_key, describe_key, describe_ranks, ranks_of, run_key, same_run
from .simulation import STRATEGIES

FORMAT = 1
HINT = "write one with `moegraph plan --out`"


@dataclass
class Plan:
    key: dict
    pool: str
    layers: list[dict]
    pools: dict[str, int]
    predicted_peak: int
    budget: int | None = None
    extra: dict = field(default_factory=dict)

    def layer_scopes(self) -> dict[int, list[str]]:
        """Layer -> the requested scopes it captures ("attn", "moe"; moe covers mlp)."""
        return {int(layer["layer"]): list(layer["scopes"]) for layer in self.layers}

    def scope_groups(self) -> dict[str, str | None]:
        """Model scope name -> pool group name; None = private pools (per_entry)."""
        out: dict[str, str | None] = {}
        for layer in self.layers:
            out.update(layer.get("groups") or {})
        return out

    def layer_recompute(self) -> dict[int, dict[str, str]]:
        """Layer -> {scope kind: recompute mode} (models/common/recompute.set_recompute);
        every layer of the plan is listed, {} for none."""
        return {int(layer["layer"]): dict(layer.get("recompute") or {})
                for layer in self.layers}

    def loss_chunk(self) -> int:
        """Rows a chunk of the loss-only head (models/common/loss_chunked.py); 0 (and a plan
        written before the field): the logits whole."""
        return int(self.extra.get("loss_chunk") or 0)

    def predicted_pool_bytes(self) -> dict[str, int]:
        return dict(self.pools)

    def to_dict(self) -> dict:
        return {"moegraph_plan": FORMAT, "key": self.key, "pool": self.pool,
                "budget": self.budget, "predicted_peak": self.predicted_peak,
                **self.extra, "pools": self.pools, "layers": self.layers}


def write_plan(path: str | Path, plan: Plan) -> None:
    """Atomically (outputs.py): a reader never sees half a plan."""
    from ..io.outputs import write_text_atomically

    write_text_atomically(path, yaml.safe_dump(plan.to_dict(), sort_keys=False, width=100))


def load_plan(path: str | Path, profile: Profile, world: int = 1, ep: int = 1) -> Plan:
    """Read a plan and check it was made for `profile`'s run on `world` ranks with `ep`-way
    expert parallelism (1, 1: one process); one-line errors, with the line, otherwise."""
    path = Path(path)
    where = f"plan {path}"
    raw = read_document(path, "plan", HINT, syntax="YAML")
    check_format(raw, where, "moegraph_plan", FORMAT, "a moegraph plan", HINT)
    for name, ok, what in (("key", lambda v: isinstance(v, dict), "a mapping"),
                           ("pool", lambda v: v in (*STRATEGIES, "none"),
                            f"one of {', '.join(STRATEGIES)}, none"),
                           ("layers", lambda v: isinstance(v, list), "a list"),
                           ("pools", lambda v: isinstance(v, dict), "a mapping"),
                           ("predicted_peak", is_bytes, "a byte count"),
                           ("budget", lambda v: v is None or is_bytes(v), "a byte count")):
        if name not in raw and name != "budget":
            raise UsageError(f"{at(where, raw)}: field {name!r} is missing")
        if not ok(raw.get(name)):
            raise UsageError(f"{at(where, raw, name)}: field {name!r} must be {what}, got "
                             f"{show(raw[name])}")
    check_key(raw["key"], where)
    for name, size in raw["pools"].items():
        if not isinstance(name, str) or not is_bytes(size):
            raise UsageError(f"{at(where, raw['pools'], name)}: pool {show(name)} must have a "
                             f"byte count, got {show(size)}")
    want = run_key(profile, world, ep)
    if not same_run(raw["key"], want):
        made = ranks_of(raw["key"])
        if same_run(raw["key"], {**want, "world": made[0], "ep": made[1]}):  # only the ranks
            again = " without --nproc/--ep" if (world, ep) == (1, 1) else \
                f" with --nproc {world} --ep {ep}"
            raise UsageError(f"plan {path} was made for {describe_ranks(raw['key'])}, not this "
                             f"run's {describe_ranks(want)}; run `moegraph plan` again{again}")
        raise UsageError(f"plan {path} was made for {describe_key(raw['key'])}, not this run "
                         f"{describe_key(want)}; run `moegraph plan` again")
    layers = profile.model.num_hidden_layers
    seen: set[int] = set()
    for item in raw["layers"]:
        if not isinstance(item, dict) or not is_int(item.get("layer")) \
                or not 0 <= item["layer"] < layers:
            if isinstance(item, dict):
                line, got = at(where, item, "layer"), show(item.get("layer"))
            else:
                line, got = at(where, raw, "layers"), f"entry {show(item)}"
            raise UsageError(f"{line}: layer {got} is not a layer of {profile.name} "
                             f"(0..{layers - 1})")
        layer = item["layer"]
        if layer in seen:
            raise UsageError(f"{at(where, item, 'layer')}: layer {layer} appears twice")
        seen.add(layer)
        scopes = item.get("scopes")
        if not isinstance(scopes, list) or any(s not in ("attn", "moe") for s in scopes):
            raise UsageError(f"{at(where, item, 'scopes')}: layer {layer} has scopes "
                             f"{show(scopes)}; expected a list of attn, moe")
        _check_recompute(where, item, profile, layer)
        groups = item.get("groups")
        if groups is None:
            continue
        names = _scope_names(profile, layer)
        if not isinstance(groups, dict):
            raise UsageError(f"{at(where, item, 'groups')}: layer {layer} has groups "
                             f"{show(groups)}; expected a mapping of scope name to pool group")
        for name, group in groups.items():
            if name not in names:
                raise UsageError(f"{at(where, groups, name)}: layer {layer} groups scope "
                                 f"{show(name)}, which is not one of its scopes "
                                 f"({', '.join(names)})")
            if group is not None and not isinstance(group, str):
                raise UsageError(f"{at(where, groups, name)}: the pool group of {name} must be "
                                 f"a name or null, got {show(group)}")
    chunk = raw.get("loss_chunk", 0)
    if not (is_int(chunk) and chunk >= 0):
        raise UsageError(f"{at(where, raw, 'loss_chunk')}: field 'loss_chunk' must be 0 (the "
                         f"logits whole) or a positive number of rows, got {show(chunk)}")
    extra = {k: v for k, v in raw.items()
             if k not in ("moegraph_plan", "key", "pool", "layers", "pools", "predicted_peak",
                          "budget")}
    return Plan(key=plain(raw["key"]), pool=raw["pool"], layers=plain(raw["layers"]),
                pools={k: int(v) for k, v in raw["pools"].items()},
                predicted_peak=raw["predicted_peak"], budget=raw.get("budget"),
                extra=plain(extra))


def _check_recompute(where: str, item: dict, profile: Profile, layer: int) -> None:
    modes = item.get("recompute")
    if modes is None:
        return
    kinds = ["attn", "moe" if profile.model.is_moe_layer(layer) else "mlp"]
    if not isinstance(modes, dict):
        raise UsageError(f"{at(where, item, 'recompute')}: layer {layer} has recompute "
                         f"{show(modes)}; expected a mapping of scope kind to mode")
    for kind, mode in modes.items():
        if kind not in kinds or mode not in SCOPE_MODES[kind]:
            allowed = "; ".join(f"{k}: {', '.join(SCOPE_MODES[k])}" for k in kinds)
            raise UsageError(f"{at(where, modes, kind)}: layer {layer} recompute "
                             f"{show(kind)}: {show(mode)} is not one of ({allowed})")


def _scope_names(profile: Profile, layer: int) -> list[str]:
    """The model scopes of one layer, as GraphSession and the plan's `groups` name them."""
    ffn = "moe" if profile.model.is_moe_layer(layer) else "mlp"
    return [f"layers.{layer}.attn", f"layers.{layer}.{ffn}"]
