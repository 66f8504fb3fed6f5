"""The demos' training recipes are pinned: every key of each stage's resolved train config (as ``make demo`` and
``make demo-ruler`` pass it to the trainer) equals ``tests/assets/demo_recipe.json`` /
``demo_ruler_recipe.json``, so a change of a recipe -- in ``configs/demo/`` or ``configs/demo_ruler/``, or of a
trainer default it relies on -- is a decision made in a commit, not a side effect.

After a deliberate change: ``python tests/pipeline/test_demo_recipe.py`` rewrites the assets; the commit says why and
docs/demo.md gives the new recipe's measured per-seed table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
ASSET = ROOT / "tests" / "assets" / "demo_recipe.json"
ASSETS = {
    "configs/demo/demo.yaml": ASSET,
    "configs/demo_ruler/demo.yaml": ROOT / "tests" / "assets" / "demo_ruler_recipe.json",
}
"""Each pinned demo config and the asset that pins its stages."""
PLACES = ("run_dir", "data.path", "checkpoint.init_from")
"""Keys naming where a run reads and writes, which differ between machines; everything else is the recipe."""


def _flat(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        out: dict[str, object] = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def resolved_recipe(demo_yaml: str = "configs/demo/demo.yaml") -> dict[str, dict[str, object]]:
    """``{stage: {dotted key: value}}`` of the GCA model's stages, resolved as the trainer resolves them."""
    from pipeline.demos.demo import MODEL_OVERRIDES, load_demo_config
    from pipeline.train.config import load_config

    cfg, _ = load_demo_config(ROOT / demo_yaml, [])
    recipe = {}
    for stage in cfg.train_stages:
        overrides = [*MODEL_OVERRIDES["gca"], *stage.overrides, *cfg.train_overrides]
        train = load_config(ROOT / cfg.gca_config, overrides, world_size=cfg.ranks)
        flat = _flat(OmegaConf.to_container(OmegaConf.structured(train)))
        recipe[stage.name] = {key: value for key, value in sorted(flat.items()) if key not in PLACES}
    return recipe


@pytest.mark.parametrize("demo_yaml", list(ASSETS))
def test_the_demo_recipe_is_the_pinned_one(demo_yaml):
    pinned = json.loads(ASSETS[demo_yaml].read_text())
    got = json.loads(json.dumps(resolved_recipe(demo_yaml)))  # the asset's own types (tuples as lists)
    assert list(got) == list(pinned), "the demo's stages changed"
    for stage in pinned:
        changed = {
            key: (pinned[stage].get(key, "<absent>"), got[stage].get(key, "<absent>"))
            for key in sorted(set(pinned[stage]) | set(got[stage]))
            if pinned[stage].get(key, "<absent>") != got[stage].get(key, "<absent>")
        }
        assert not changed, (
            f"stage {stage} of {demo_yaml}: the recipe changed (pinned, now): {changed}; if on purpose, rerun "
            "`python tests/pipeline/test_demo_recipe.py` and measure the per-seed table again (docs/demo.md)"
        )


def test_the_recipe_holds_what_its_docs_say():
    """The settings docs/demo.md explains, read from the pinned asset (so the asset itself cannot drift)."""
    pinned = json.loads(ASSET.read_text())
    short, long_ = pinned["short"], pinned["long"]
    assert (short["train.seq_len"], short["train.max_steps"], long_["train.seq_len"], long_["train.max_steps"]) == (
        64,
        400,
        1024,
        450,
    )
    families = "data.retrieval_mix.families"
    assert (short[f"{families}.single"], short[f"{families}.multikey"]) == (2.0, 0.0)  # single needles only
    assert (long_[f"{families}.single"], long_[f"{families}.multikey"]) == (2.0, 1.0)
    for stage in (short, long_):
        assert stage["data.retrieval_mix.fraction"] == 1.0 and stage["data.retrieval_mix.answer_weight"] == 20.0
        assert stage["seed"] == 0 and stage["optim.lr"] == 5e-4 and stage["model.top_k"] == 2


def test_demo_ruler_long_is_demo_ruler_with_its_mixed_stage_twice():
    """``make demo-ruler-long`` is ``make demo-ruler``'s pinned recipe, its mixed stage run once more, and the same
    evaluation; only the run directory differs (so the two never share stages)."""
    from pipeline.demos.demo import load_demo_config

    short, long_ = resolved_recipe("configs/demo_ruler/demo.yaml"), resolved_recipe("configs/demo_ruler/long.yaml")
    assert list(long_) == [*short, "again"]
    for stage in short:
        assert long_[stage] == short[stage], stage
    assert long_["again"] == short["mixed"]
    demo, longer = (
        OmegaConf.to_container(OmegaConf.structured(load_demo_config(ROOT / "configs/demo_ruler" / name, [])[0]))
        for name in ("demo.yaml", "long.yaml")
    )
    assert isinstance(demo, dict) and isinstance(longer, dict)
    assert (demo.pop("run_dir"), longer.pop("run_dir")) == ("runs/demo_ruler", "runs/demo_ruler_long")
    assert len(longer.pop("train_stages")) == len(demo.pop("train_stages")) + 1
    assert longer == demo


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for demo_yaml, asset in ASSETS.items():
        asset.write_text(json.dumps(resolved_recipe(demo_yaml), indent=1) + "\n")
        print(f"wrote {asset}")
