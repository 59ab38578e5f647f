"""The notebooks' tables for people: no index column, three significant figures, whole numbers
whole, units in the headers, every cell whole (long ones wrap), dicts as small tables,
and nothing of a cell read as HTML."""

import re

import numpy as np
import pandas as pd

from draftsmith import tables

import pytest

pytestmark = pytest.mark.unit


def cells(html: str) -> list[str]:
    return [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>.*?</td>", html, re.S)]


def test_a_table_has_no_index_three_significant_figures_and_units_in_its_headers():
    df = pd.DataFrame({"provider": ["A", "B"], "price_out": [2.5, 3.123456], "latency_p50_s": [0.123456, None],
                       "output_tokens": [1234567, 12], "cost_mix": [0.000123456, 1234.5678],
                       "allowed": np.array([True, False])}, index=[5, 7])
    html = tables.show(df).to_html()
    assert "row_heading" not in html and ">5<" not in html
    headers = re.findall(r'class="col_heading[^"]*" >([^<]*)<', html)
    assert headers == ["provider", "price out ($/M tokens)", "latency p50 (s)", "output tokens", "cost mix (USD)",
                       "allowed"]
    assert cells(html) == ["A", "2.5", "0.123", "1,234,567", "0.000123", "yes",
                           "B", "3.12", "n/a", "12", "1,235", "no"]


def test_row_labels_become_the_first_column_and_row_numbers_are_dropped():
    named = pd.DataFrame({"samples": [3, 4]}, index=pd.Index(["code", "chat"], name="dataset"))
    assert re.findall(r'class="col_heading[^"]*" >([^<]*)<', tables.show(named).to_html()) == ["dataset", "samples"]
    assert cells(tables.show(named).to_html()) == ["code", "3", "chat", "4"]
    labels = pd.DataFrame({"id": [3, 22]}, index=["low", "high"])
    assert cells(tables.show(labels).to_html()) == ["low", "3", "high", "22"]


def test_a_long_cell_is_shown_whole_wrapping_in_a_bounded_column_and_escaped():
    full = 'temperature,top_p,"seed",<tools>,' + "x" * 80
    html = tables.show(pd.DataFrame({"supported_parameters": [full, "short"]})).to_html()
    assert cells(html) == [full.replace("<", "&lt;").replace(">", "&gt;").replace('"', "&#34;"), "short"]
    assert "<tools>" not in html and "…" not in html
    assert "max-width: 36em" in html and "overflow-wrap: normal" in html and "word-break: normal" in html   # no mid-word break


def test_a_column_with_one_value_in_every_row_is_dropped_and_said_once_above_the_table():
    df = pd.DataFrame({"endpoint": ["moonshotai/int4", "novita/int4"], "quantization": ["int4", "int4"],
                       "lossless": [True, True], "price_out": [2.5, 3.0]})
    html = tables.show(df, title="endpoints").to_html()
    assert re.findall(r'class="col_heading[^"]*" >([^<]*)<', html) == ["endpoint", "price out ($/M tokens)"]
    assert "endpoints · same in every row: quantization int4; lossless yes</caption>" in html
    one = tables.show(df.head(1)).to_html()   # one row: every column is shown
    assert len(re.findall(r'class="col_heading', one)) == 4 and "<caption>" not in one


def test_a_dict_is_a_small_table_nested_keys_joined():
    html = tables.dict_table({"order": ["a", "b"], "allow_fallbacks": False,
                              "max_price": {"prompt": 1, "completion": 2.5}}).to_html()
    assert cells(html) == ["order", "a, b", "allow_fallbacks", "no", "max_price / prompt", "1",
                           "max_price / completion", "2.5"]


def test_nothing_to_show_says_none():
    assert cells(tables.show(None).to_html()) == ["none"]
    assert cells(tables.show(pd.DataFrame(columns=["a"])).to_html()) == ["none"]
