"""``make demo-cpt``'s training recipe is pinned: every key of each stage's resolved train config (as the demo passes
it to the trainer, less the places it reads and writes) equals ``tests/assets/demo_cpt_recipe.json``, so a change of
the recipe -- in ``configs/demo_cpt/``, or of a trainer default it relies on -- is a decision made in a commit, not a
side effect. The dense model's shape keys are read from its checkpoint when the stage starts
(``checkpoint.init_from``); what is pinned here is what the demo's configs decide.

After a deliberate change: ``python tests/pipeline/test_demo_cpt_recipe.py`` rewrites the asset; the commit says why
and docs/cpt.md gives the new recipe's measured result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
ASSET = ROOT / "tests" / "assets" / "demo_cpt_recipe.json"
PLACES = ("run_dir", "data.path", "checkpoint.init_from")
"""Keys naming where a run reads and writes, which differ between machines; everything else is the recipe."""


def _flat(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        out: dict[str, object] = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def resolved_recipe() -> dict[str, dict[str, object]]:
    """``{stage: {dotted key: value}}`` of both training stages, resolved as the trainer resolves them."""
    from pipeline.demos.demo_cpt import load_demo_cpt_config
    from pipeline.train.config import load_config

    cfg, _ = load_demo_cpt_config(ROOT / "configs/demo_cpt/demo_cpt.yaml", [])
    recipe = {}
    for name, extra in (("stage1", cfg.stage1), ("stage2", cfg.stage2)):
        if extra is None:  # no such stage
            continue
        train = load_config(ROOT / cfg.train_config, [*extra, *cfg.train_overrides], world_size=cfg.ranks)
        flat = _flat(OmegaConf.to_container(OmegaConf.structured(train)))
        recipe[name] = {key: value for key, value in sorted(flat.items()) if key not in PLACES}
    return recipe


def test_the_demo_cpt_recipe_is_the_pinned_one():
    pinned = json.loads(ASSET.read_text())
    got = json.loads(json.dumps(resolved_recipe()))  # the asset's own types (tuples as lists)
    assert list(got) == list(pinned), "the demo's stages changed"
    for stage in pinned:
        changed = {
            key: (pinned[stage].get(key, "<absent>"), got[stage].get(key, "<absent>"))
            for key in sorted(set(pinned[stage]) | set(got[stage]))
            if pinned[stage].get(key, "<absent>") != got[stage].get(key, "<absent>")
        }
        assert not changed, (
            f"stage {stage}: the demo-cpt recipe changed (pinned, now): {changed}; if on purpose, rerun "
            "`python tests/pipeline/test_demo_cpt_recipe.py` and measure make demo-cpt again (docs/cpt.md)"
        )


def test_the_recipe_holds_what_its_docs_say():
    """The settings docs/cpt.md explains, read from the pinned asset (so the asset itself cannot drift)."""
    pinned = json.loads(ASSET.read_text())
    assert list(pinned) == ["stage1"]  # one training stage
    one = pinned["stage1"]
    assert (one["train.seq_len"], one["train.global_batch"], one["train.max_steps"], one["seed"]) == (
        128,
        64,
        600,
        1234,
    )
    assert one["data.retrieval_mix.families.single"] == 1.0 and "data.retrieval_mix.families.multikey" not in one
    assert one["model.window"] == 32 and one["model.top_k"] == 4 and one["optim.trainable"] == "all"
    assert one["data.retrieval_mix.fraction"] == 1.0 and one["data.retrieval_mix.retriever_loss"] == 1.0
    assert one["data.retrieval_mix.answer_weight"] == 20.0 and one["optim.lr"] == 5e-4
    assert (one["optim.lr_scale.retriever"], one["optim.lr_scale.gca"], one["optim.lr_scale.memory"]) == (2.0, 4.0, 4.0)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    ASSET.write_text(json.dumps(resolved_recipe(), indent=1) + "\n")
    print(f"wrote {ASSET}")
