"""The plan file `moegraph plan --out` writes and `moegraph capture --plan` follows.

    moegraph_plan: 1
    key: {profile, batch, seq_len, dtype, moe_mode, capacity_factor, model_hash, world, ep}
    pool: shared                    # strategy: shared | per_scope | per_entry
    budget: B    predicted_peak: B    static_bytes: B    eager_peak: B    pool_bytes: B
    pools: {shared: B}              # predicted bytes per pool, named as GraphSession.pools()
    layers:
    - {layer: 0, scopes: [attn, moe], pool: shared,
       groups: {layers.0.attn: shared, layers.0.moe: shared}, predicted_bytes: B}
    left_out: ["moe on layers 6-11: ..."]

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
from ..errors import UsageError
from .documents import read_document
from .memory import describe_key, describe_ranks, ranks_of, run_key, same_run

FORMAT = 1


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

    def predicted_pool_bytes(self) -> dict[str, int]:
        return dict(self.pools)

    def to_dict(self) -> dict:
        return {"moegraph_plan": FORMAT, "key": self.key, "pool": self.pool,
                "budget": self.budget, "predicted_peak": self.predicted_peak,
                **self.extra, "pools": self.pools, "layers": self.layers}


def write_plan(path: str | Path, plan: Plan) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(plan.to_dict(), sort_keys=False, width=100))


def load_plan(path: str | Path, profile: Profile, world: int = 1, ep: int = 1) -> Plan:
    """Read a plan and check it was made for `profile`'s run on `world` ranks with `ep`-way
    expert parallelism (1, 1: one process); one-line errors otherwise."""
    path = Path(path)
    raw = read_document(path, "plan", "write one with `moegraph plan --out`", syntax="YAML")
    if not isinstance(raw, dict) or raw.get("moegraph_plan") != FORMAT:
        raise UsageError(f"plan {path}: not a moegraph plan (expected moegraph_plan: {FORMAT})")
    for name, typ in (("key", dict), ("pool", str), ("layers", list), ("pools", dict),
                      ("predicted_peak", int)):
        if not isinstance(raw.get(name), typ):
            raise UsageError(f"plan {path}: field {name!r} is missing or not a "
                             f"{typ.__name__}")
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
    for item in raw["layers"]:
        if not isinstance(item, dict) or not isinstance(item.get("layer"), int) \
                or not 0 <= item["layer"] < layers:
            raise UsageError(f"plan {path}: layer entry {item!r} is not a layer of "
                             f"{profile.name} (0..{layers - 1})")
        bad = [s for s in item.get("scopes") or [] if s not in ("attn", "moe")]
        if bad or not isinstance(item.get("scopes"), list):
            raise UsageError(f"plan {path}: layer {item['layer']} has scopes "
                             f"{item.get('scopes')!r}; expected a list of attn, moe")
    extra = {k: v for k, v in raw.items()
             if k not in ("moegraph_plan", "key", "pool", "layers", "pools", "predicted_peak",
                          "budget")}
    return Plan(key=raw["key"], pool=raw["pool"], layers=raw["layers"],
                pools={str(k): int(v) for k, v in raw["pools"].items()},
                predicted_peak=raw["predicted_peak"], budget=raw.get("budget"), extra=extra)
