"""Status rendering helpers (status.py) that the integration tests cannot reach at every width."""

from __future__ import annotations

from rich.cells import cell_len

from onward.status import cut_middle


def test_long_texts_are_cut_in_the_middle_keeping_start_and_end() -> None:
    url = "https://example.com/" + "x" * 100 + "/page-1"
    cut = cut_middle(url, 30)
    assert len(cut) == 30 and cut.startswith("https://exampl") and cut.endswith("/page-1") and "…" in cut
    assert cut_middle("short", 30) == "short"


def test_wide_characters_are_cut_by_terminal_cells() -> None:
    cut = cut_middle("漢字" * 20, 11)
    assert cell_len(cut) <= 11 and cut.startswith("漢字") and cut.endswith("漢字") and "…" in cut
