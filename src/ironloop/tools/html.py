"""One self-contained HTML page from markdown-like parts: the writer of ``ironloop report``'s and
``ironloop lab``'s ``report.html``.

Images are embedded as base64 data URIs and the style is inline, so the file can be mailed or
attached to a ticket and opened anywhere. A viewport meta tag and wrapping containers keep it
readable on a phone (wide tables scroll inside their own box, not the page).
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

text = partial(html.escape, quote=False)  # element content: quotes need no escaping

STYLE = ("body{font-family:sans-serif;max-width:980px;margin:2em auto;padding:0 1em;"
         "line-height:1.4}div.t{overflow-x:auto}table{border-collapse:collapse;margin:.5em 0}"
         "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
         "td:first-child,th:first-child{text-align:left}table.l td{text-align:left}"
         "td.PASS{color:#060}td.FAIL{color:#b00;font-weight:bold}img{max-width:100%;"
         "height:auto}pre{background:#f6f6f6;padding:8px;overflow-x:auto}"
         "figcaption{color:#555;font-size:small}blockquote{color:#555;margin-left:1em}")


@dataclass
class Page:
    """Build with ``h2``, ``p``, ``table``, ``items``, ``pre``, ``image``; ``write`` it."""

    title: str
    parts: list[str] = field(default_factory=list)

    def h2(self, heading: str) -> Page:
        self.parts.append(f"<h2>{text(heading)}</h2>")
        return self

    def p(self, para: str, bold: str = "") -> Page:
        lead = f"<b>{text(bold)}</b> " if bold else ""
        self.parts.append(f"<p>{lead}{text(para)}</p>")
        return self

    def note(self, para: str) -> Page:
        self.parts.append(f"<blockquote>{text(para)}</blockquote>")
        return self

    def table(self, header: list[str], rows: list[list], css: str = "",
              classed: int | None = None) -> Page:
        """A table; column ``classed`` also becomes each cell's class (PASS/FAIL colours)."""
        esc = html.escape
        head = "".join(f"<th>{text(str(h))}</th>" for h in header)
        body = "".join(
            "<tr>" + "".join(f'<td class="{esc(str(c))}">{text(str(c))}</td>' if i == classed
                             else f"<td>{text(str(c))}</td>" for i, c in enumerate(row)) + "</tr>"
            for row in rows)
        cls = f" class='{css}'" if css else ""
        self.parts.append(f"<div class='t'><table{cls}><tr>{head}</tr>{body}</table></div>")
        return self

    def items(self, items: list[tuple[str, str]]) -> Page:
        """A bullet list of (bold lead, text)."""
        self.parts.append("<ul>" + "".join(f"<li><b>{text(a)}</b> {text(b)}</li>"
                                           for a, b in items) + "</ul>")
        return self

    def pre(self, body: str) -> Page:
        self.parts.append(f"<pre>{text(body)}</pre>")
        return self

    def image(self, path: Path) -> Page:
        b64 = base64.b64encode(Path(path).read_bytes()).decode()
        name = html.escape(Path(path).name)
        self.parts.append(f'<figure><img alt="{name}" src="data:image/png;base64,{b64}">'
                          f"<figcaption>{name}</figcaption></figure>")
        return self

    def render(self) -> str:
        title = text(self.title)
        return ("<!doctype html><html lang='en'><head><meta charset='utf-8'>"
                "<meta name='viewport' content='width=device-width, initial-scale=1'>"
                f"<title>{title}</title><style>{STYLE}</style></head><body>"
                f"<h1>{title}</h1>" + "".join(self.parts) + "</body></html>\n")

    def write(self, path: Path) -> Path:
        Path(path).write_text(self.render(), encoding="utf-8")
        return Path(path)
