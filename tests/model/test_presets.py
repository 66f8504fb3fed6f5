"""The named model sizes (``model.preset``): overrides replace a preset's values, an unknown name is refused."""

import pytest

from model import ConfigError, preset
from model.presets import PRESETS


def test_overrides_replace_the_preset_values_and_leave_the_preset_as_it_was():
    cfg = preset("tiny", d_model=32, groups=[2])
    assert (cfg.d_model, cfg.groups, cfg.window) == (32, [2], PRESETS["tiny"]["window"])
    cfg.groups.append(3)
    assert preset("tiny").groups == PRESETS["tiny"]["groups"] == [1]


def test_unknown_preset_is_named_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"no model preset 'huge'; the presets are \['bench', 'bench-eval', 'tiny'\]"):
        preset("huge")
