"""The report's stylesheet, inlined so the HTML file stands alone (mail it, archive it)."""

from __future__ import annotations

from typing import Final

#: Fill colour of each state: badges, table accents and timeline bars share it.
STATE_COLOURS: Final[dict[str, str]] = {
    "succeeded": "#1a7f37",
    "failed": "#cf222e",
    "cancelled": "#bc4c00",
    "skipped": "#8c959f",
    "running": "#0969da",
    "retrying": "#9a6700",
    "queued": "#8250df",
    "pending": "#6e7781",
}
UNKNOWN_COLOUR: Final = "#6e7781"


def _state_rules() -> str:
    rules = [
        f".state-{state}{{--state:{colour}}}" for state, colour in STATE_COLOURS.items()
    ]
    return "\n".join(rules)


CSS: Final = (
    """
:root{--fg:#1f2328;--muted:#59636e;--bg:#f6f8fa;--card:#fff;--line:#d1d9e0;
--pre:#f6f8fa;--state:#6e7781;color-scheme:light dark}
@media (prefers-color-scheme:dark){:root{--fg:#e6edf3;--muted:#9198a1;--bg:#0d1117;
--card:#151b23;--line:#3d444d;--pre:#0d1117}}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);
font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif}
main{max-width:1180px;margin:0 auto;padding:24px 16px 48px}
section,header.run{background:var(--card);border:1px solid var(--line);border-radius:8px;
padding:16px 20px;margin:0 0 16px}
h1{font-size:22px;margin:0 0 8px;display:flex;gap:12px;align-items:center;flex-wrap:wrap}
h2{font-size:16px;margin:0 0 12px}
h3{font-size:13px;margin:14px 0 6px;color:var(--muted);text-transform:uppercase;
letter-spacing:.04em}
.badge{display:inline-block;padding:1px 10px;border-radius:999px;color:#fff;
background:var(--state);font-size:12px;font-weight:600;line-height:20px;white-space:nowrap}
h1 .badge{font-size:14px;line-height:24px}
dl.meta{display:grid;grid-template-columns:max-content 1fr max-content 1fr;gap:4px 16px;
margin:8px 0 0}
dl.meta dt{color:var(--muted)}
dl.meta dd{margin:0;overflow-wrap:anywhere}
.summary{margin:12px 0 0;font-weight:600}
.reason{margin:8px 0 0;color:var(--muted)}
.table-wrap{overflow-x:auto}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:6px 10px;border-bottom:1px solid var(--line);
vertical-align:top}
th{color:var(--muted);font-weight:600;font-size:12px;white-space:nowrap}
td.num{font-variant-numeric:tabular-nums;white-space:nowrap}
td.time{white-space:nowrap;font-variant-numeric:tabular-nums}
td.name a{color:inherit;font-weight:600;text-decoration:none}
td.name a:hover{text-decoration:underline}
.exit-bad{color:#cf222e;font-weight:600}
.sim{display:inline-block;margin-left:6px;padding:0 6px;border:1px dashed currentColor;
border-radius:4px;font-size:11px;color:var(--muted)}
.muted{color:var(--muted)}
svg.timeline{width:100%;height:auto;display:block}
svg.timeline text{fill:var(--fg);font-size:12px}
svg.timeline .axis text{fill:var(--muted);font-size:11px}
svg.timeline .axis line{stroke:var(--line)}
svg.timeline rect.bar{fill:var(--state)}
svg.timeline rect.bar.open{fill-opacity:.55}
.legend{margin:8px 0 0}
.legend .badge{margin-right:4px}
details{border-top:1px solid var(--line);padding:8px 0}
details:first-of-type{border-top:0}
summary{cursor:pointer}
summary .badge{margin-right:6px}
summary .name{font-weight:600;margin-right:8px}
pre{background:var(--pre);border:1px solid var(--line);border-radius:6px;padding:10px 12px;
margin:0;overflow:auto;max-height:480px;white-space:pre-wrap;overflow-wrap:anywhere;
font:12px/1.45 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
footer{color:var(--muted);font-size:12px;text-align:center}
.figures{display:grid;grid-template-columns:repeat(auto-fill,minmax(380px,1fr));gap:12px 20px}
figure{margin:0 0 12px}
figure svg{width:100%;height:auto;background:#fff;border-radius:6px;display:block}
figcaption{color:var(--muted);font-size:12px}
ul.outputs{margin:0;padding-left:20px}
h3.step{font-size:14px;text-transform:none;letter-spacing:0;color:var(--fg)}
h3.step a{color:inherit}
@media print{pre{max-height:none}details{break-inside:avoid}}
"""
    + _state_rules()
    + "\n"
)
