"""The conformance kit's parity bound, measured from the reference's own float32 noise (measure_noise_floor).

Independent route: the float64 distance is recomputed here with transformers directly, and
the bound must follow the documented rule max(5 x noise, 1e-5).
"""

from __future__ import annotations

import torch

from lollm.load.loader import load_checkpoint
from lollm.proof.parity import default_reference
from lollm.testing.conformance import BOUND_FLOOR, NOISE_FACTOR, measure_noise_floor
from lollm.cli.hub_configs import hub_config
from lollm.testing.tiny import SENSITIVE_INIT_STD, kit_config, write_tiny_checkpoint


def test_the_bound_is_five_times_the_float64_distance_of_the_reference(tmp_path):
    import transformers

    folder = write_tiny_checkpoint(kit_config(hub_config("Qwen__Qwen3-0.6B")), tmp_path / "q", init_std=SENSITIVE_INIT_STD)
    checkpoint = load_checkpoint(folder)
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    floor = measure_noise_floor(default_reference, checkpoint, ids)

    with torch.inference_mode():
        logits = {dtype: transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)(ids).logits[0].double()
                  for dtype in (torch.float32, torch.float64)}
    expected = float((logits[torch.float64].float().double() - logits[torch.float32]).abs().max())
    assert 0 < floor.float64 < 1e-3
    assert abs(floor.float64 - expected) <= 1e-6 * max(1.0, expected) + 1e-9, (floor, expected)
    assert floor.noise == max(floor.float64, floor.batch)
    assert floor.bound == max(NOISE_FACTOR * floor.noise, BOUND_FLOOR)
    assert measure_noise_floor(default_reference, checkpoint, ids) is floor  # measured once per checkpoint and prompt
