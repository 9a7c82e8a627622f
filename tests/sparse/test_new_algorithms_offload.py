"""The sub-page-box and key-code algorithms under forced offload (a tiny device pool): the
device cache sees only pages, so the output equals everything resident, token for token."""
import pytest

from tests.kvcache.test_offload_engine import (check_forced_offload_equals_resident,  # noqa: F401
                                               model_dir)


@pytest.mark.parametrize("algo", ["arkvale-b8", "quest-b16", "keycode1", "keycode2", "keycode2-sl",
                                  "keycode2-sl2", "keycode2-sparq"])
def test_forced_offload_equals_resident_new_algorithms(model_dir, algo):  # noqa: F811
    check_forced_offload_equals_resident(model_dir, algo)
