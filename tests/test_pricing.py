"""Money questions answered once for stages 01 and 02: the worst case of a request, the formats a
routing name covers, and the balance left."""

import pytest

from draftsmith.openrouter import pricing
from draftsmith.openrouter.api import Api
from draftsmith.openrouter.apikey import ApiKey
from draftsmith.openrouter.budget import SpendBudget
from draftsmith.emulator import running
from draftsmith.openrouter.pricing import below_native, routed

pytestmark = pytest.mark.emulator

MODEL = "moonshotai/kimi-k2.5"


def _ep(tag, quant="int4", prompt=1e-6, completion=4e-6, **extra):
    return {"provider_name": tag.split("/")[0], "tag": tag, "quantization": quant,
            "pricing": {"prompt": str(prompt), "completion": str(completion), **extra}}


def test_stage_01_and_stage_02_price_the_worst_case_by_one_rule():
    eps = [_ep("a/int4", overrides=[{"prompt": "3e-6"}]),
           _ep("b/int4", completion=5e-6, request="0.001"),
           _ep("c/fp8", completion=2e-6, internal_reasoning="9e-6")]
    # stage 02 reserves at the highest price among the endpoints routing may pick
    cat = pricing.catalogue(eps, MODEL, {"only": ["a/int4", "b/int4", "c/fp8"]})
    assert (cat.prompt_price, cat.completion_price, cat.request_price) == pytest.approx((3e-6, 9e-6, 0.001))
    budget = SpendBudget(1.0)
    budget.set_prices(cat.prompt_price, cat.completion_price, cat.request_price)
    assert budget.worst_cost(100, 50) == pytest.approx(100 * 3e-6 + 50 * 9e-6 + 0.001)
    # stage 01's pilot, routed the same way, from its endpoint table: the same figure per request
    worst = pricing.highest(pricing.table_worst_prices(pricing.endpoint_table(eps)))
    assert worst.cost(100 * 4, 50 * 4, 4) == pytest.approx(4 * budget.worst_cost(100, 50))
    # the probe sends to every endpoint: each at its own worst price
    each = pricing.table_worst_prices(pricing.endpoint_table(eps))
    assert sum(p.cost(10, 5) for p in each) == pytest.approx(
        (10 * 3e-6 + 5 * 4e-6) + (10 * 1e-6 + 5 * 5e-6 + 0.001) + (10 * 1e-6 + 5 * 9e-6))


def test_a_quantization_family_means_the_same_endpoints_to_both_stages():
    assert routed(["fp4", "int4"]) == {"fp4", "mxfp4", "nvfp4", "int4"} and "mxfp8" in routed(["fp8"])
    eps = [_ep("a/nvfp4", "nvfp4"), _ep("b/mxfp8", "mxfp8"), _ep("c/int4", "int4")]
    assert [pricing.endpoint_allowed(e, {"quantizations": ["fp4"]}) for e in eps] == [True, False, False]
    assert [pricing.endpoint_allowed(e, {"quantizations": ["fp8"]}) for e in eps] == [False, True, False]
    # every member of the fp4 family is below native int4 weights; fp8 holds them exactly
    assert all(below_native(q, "int4") for q in routed(["fp4"])) and not below_native("fp8", "int4")


def test_the_balance_from_the_key_then_credits_then_unknown_with_the_reason(tmp_path):
    with running({"fault_scale": 0, "credits": 4.0}, state_dir=tmp_path / "a") as emu:
        assert Api(emu.base_url, emu.key).balance() == (4.0, "/key limit_remaining")
        usd, source = Api(emu.base_url, ApiKey("sk-or-v1-wrong", "t")).balance()
        assert usd is None and "/key unreadable: HTTP 401" in source
    with running({"fault_scale": 0, "credits": 4.0, "key_capped": False}, state_dir=tmp_path / "b") as emu:
        usd, source = Api(emu.base_url, emu.key).balance()
        assert usd == 4.0 and source.startswith("/credits")
    with running({"fault_scale": 0, "key_capped": False, "credits_need_management_key": True},
                 state_dir=tmp_path / "c") as emu:
        usd, source = Api(emu.base_url, emu.key).balance()
        assert usd is None and "uncapped" in source and "/credits refused: HTTP 403" in source
