"""The report's bar charts: SVG drawn by pygal (pure Python), inline in the page.

pygal writes its text through an XML library that escapes it. Its SVG carries a config <script>
for optional JS tooltips and comments with its home page: neither belongs in a page that runs no
scripts and fetches nothing, so both are removed. Without pygal a chart is a note (the tables
below each chart have the numbers).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from markupsafe import Markup

SERIES_COLOURS = ("#5f6368", "#1a73e8", "#e8710a", "#1e8e3e", "#9334e6", "#d93025", "#12b5cb")


@dataclass
class Chart:
    """One chart for a template: its element id and its SVG (None: pygal is not installed)."""

    id: str
    svg: Markup | None


def series_colour(names: Sequence[str], name: str) -> str:
    return SERIES_COLOURS[list(names).index(name) % len(SERIES_COLOURS)]


def _style(**colors: Any) -> Any:
    from pygal.style import Style

    return Style(background="white", plot_background="white", font_family="sans-serif", label_font_size=11,
                 major_label_font_size=11, value_font_size=10, title_font_size=14, legend_font_size=12, **colors)


def _chart(chart: Any, chart_id: str) -> Chart:
    svg = chart.render(is_unicode=True)
    # pygal's ids are random: make them stable
    svg = strip_scripts_and_comments(svg).replace(f"chart-{chart.uuid}", chart_id).replace(chart.uuid, chart_id)
    return Chart(chart_id, Markup(svg))


def bar_chart(chart_id: str, labels: list[str], values: list[dict[str, Any]], *, horizontal: bool, title: str,
              value_fmt: str, size: tuple[int, int] | None = None) -> Chart:
    """One series of bars (a value may carry its own "color"). `size`: (width, height) of a small
    vertical chart, without values printed on its bars (the y axis and the table give them)."""
    try:
        import pygal
    except ImportError:
        return Chart(chart_id, None)
    n = max(len(labels), 1)
    # values printed on a small chart's bars overlapped them (a 0.03 ms bar beside a 0.3 ms one): the
    # y axis gives the scale there, and the table below each chart the exact numbers
    common = dict(style=_style(colors=("#1a73e8",)), js=[], disable_xml_declaration=True, show_legend=False,
                  title=title, print_values=horizontal,
                  value_formatter=lambda v: value_fmt.format(v), truncate_label=-1)
    if horizontal:
        chart = pygal.HorizontalBar(width=1100, height=90 + 28 * n, margin_left=10, **common)
    elif size is not None:
        chart = pygal.Bar(width=size[0], height=size[1], x_label_rotation=30, **common)
    else:
        chart = pygal.Bar(width=1100, height=460, x_label_rotation=35, **common)
    chart.x_labels = labels
    chart.add("value", values)
    return _chart(chart, chart_id)


def grouped_bar_chart(chart_id: str, labels: list[str], series: dict[str, list[float | None]], *, title: str,
                      value_fmt: str, logarithmic: bool = False) -> Chart:
    """Bars grouped by `labels` (batch sizes), one coloured series per artifact, with a legend."""
    try:
        import pygal
    except ImportError:
        return Chart(chart_id, None)
    chart = pygal.Bar(width=1100, height=420, js=[], disable_xml_declaration=True, title=title, show_legend=True,
                      legend_at_bottom=True, truncate_label=-1, value_formatter=lambda v: value_fmt.format(v),
                      style=_style(colors=SERIES_COLOURS), logarithmic=logarithmic)
    chart.x_labels = labels
    for name, values in series.items():
        chart.add(name, values)
    return _chart(chart, chart_id)


_SCRIPT_RE = re.compile(r"<script\b[^>]*>.*?</script\s*>", re.S | re.I)
_COMMENT_RE = re.compile(r"<!--.*?-->", re.S)


def strip_scripts_and_comments(svg: str) -> str:
    return _COMMENT_RE.sub("", _SCRIPT_RE.sub("", svg))
