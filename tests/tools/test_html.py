"""Tests for ironloop.tools.html: the exact HTML each part of a report page writes (escaping,
table headers and rows, PASS/FAIL cell classes, embedded images, the page's head)."""

from __future__ import annotations

import base64

from ironloop.tools.html import STYLE, Page


def _body(page: Page) -> str:
    """The page's parts as rendered, between the <h1> and </body>."""
    html = page.render()
    return html.split(f"<h1>{page.title}</h1>", 1)[1].removesuffix("</body></html>\n")


def test_a_heading_is_escaped_and_methods_chain():
    page = Page("t")
    assert page.h2("a < b & c") is page
    assert page.parts == ["<h2>a &lt; b &amp; c</h2>"]


def test_a_paragraph_escapes_its_text_but_keeps_quotes():
    page = Page("t")
    assert page.p('say "hi" <b>') is page
    assert page.parts == ['<p>say "hi" &lt;b&gt;</p>']


def test_a_paragraph_with_a_bold_lead_puts_it_first_and_escapes_it():
    page = Page("t").p("the rest", bold="Lead & <one>:")
    assert page.parts == ["<p><b>Lead &amp; &lt;one&gt;:</b> the rest</p>"]


def test_a_note_is_a_blockquote():
    page = Page("t")
    assert page.note("careful > 'here'") is page
    assert page.parts == ["<blockquote>careful &gt; 'here'</blockquote>"]


def test_a_table_writes_its_header_then_one_row_per_list_in_order():
    page = Page("t")
    assert page.table(["name", "a<b"], [["x", 1], ["y & z", 2.5]]) is page
    assert page.parts == [
        "<div class='t'><table><tr><th>name</th><th>a&lt;b</th></tr>"
        "<tr><td>x</td><td>1</td></tr><tr><td>y &amp; z</td><td>2.5</td></tr></table></div>"]


def test_a_table_with_a_css_class_and_no_rows():
    page = Page("t").table(["k", "v"], [], css="l")
    assert page.parts == ["<div class='t'><table class='l'><tr><th>k</th><th>v</th></tr>"
                          "</table></div>"]


def test_the_classed_column_gives_each_of_its_cells_its_value_as_class():
    page = Page("t").table(["check", "verdict", "note"],
                           [["a", "PASS", "ok"], ["b", "FAIL", 'x"y']], classed=1)
    assert page.parts == [
        "<div class='t'><table><tr><th>check</th><th>verdict</th><th>note</th></tr>"
        '<tr><td>a</td><td class="PASS">PASS</td><td>ok</td></tr>'
        '<tr><td>b</td><td class="FAIL">FAIL</td><td>x"y</td></tr></table></div>']
    first = Page("t").table(["v"], [['a"<b']], classed=0)  # the class attribute escapes quotes
    assert first.parts == ["<div class='t'><table><tr><th>v</th></tr>"
                           '<tr><td class="a&quot;&lt;b">a"&lt;b</td></tr></table></div>']


def test_items_are_a_bullet_list_with_bold_leads():
    page = Page("t")
    assert page.items([("one:", "a < b"), ("two & three", '"q"')]) is page
    assert page.parts == ['<ul><li><b>one:</b> a &lt; b</li><li><b>two &amp; three</b> "q"</li>'
                          "</ul>"]
    assert Page("t").items([]).parts == ["<ul></ul>"]


def test_pre_keeps_the_text_escaped():
    page = Page("t")
    assert page.pre("x = 1 < 2\n  'y'") is page
    assert page.parts == ["<pre>x = 1 &lt; 2\n  'y'</pre>"]


def test_an_image_is_embedded_as_base64_with_its_file_name(tmp_path):
    path = tmp_path / 'a&"b.png'
    path.write_bytes(b"\x89PNG fake bytes")
    page = Page("t")
    assert page.image(str(path)) is page  # a str path works too
    b64 = base64.b64encode(b"\x89PNG fake bytes").decode()
    assert page.parts == [f'<figure><img alt="a&amp;&quot;b.png" src="data:image/png;base64,'
                          f'{b64}"><figcaption>a&amp;&quot;b.png</figcaption></figure>']


def test_render_writes_a_self_contained_page_with_the_title_twice():
    page = Page('Run <1> & "2"').h2("x").p("y")
    html = page.render()
    assert html == ("<!doctype html><html lang='en'><head><meta charset='utf-8'>"
                    "<meta name='viewport' content='width=device-width, initial-scale=1'>"
                    f"<title>Run &lt;1&gt; &amp; \"2\"</title><style>{STYLE}</style></head>"
                    "<body><h1>Run &lt;1&gt; &amp; \"2\"</h1><h2>x</h2><p>y</p></body></html>\n")


def test_the_style_keeps_wide_parts_scrolling_and_colours_verdicts():
    """The rules the page relies on: a phone-width body, tables and code that scroll in their
    own box, images that shrink, PASS green and FAIL red and bold."""
    for rule in ("body{font-family:sans-serif;max-width:980px;margin:2em auto;padding:0 1em;",
                 "line-height:1.4}div.t{overflow-x:auto}table{border-collapse:collapse;",
                 "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}",
                 "td:first-child,th:first-child{text-align:left}table.l td{text-align:left}",
                 "td.PASS{color:#060}td.FAIL{color:#b00;font-weight:bold}img{max-width:100%;",
                 "height:auto}pre{background:#f6f6f6;padding:8px;overflow-x:auto}",
                 "figcaption{color:#555;font-size:small}blockquote{color:#555;margin-left:1em}"):
        assert rule in STYLE
    assert STYLE.startswith("body{") and STYLE.endswith("margin-left:1em}")


def test_write_saves_the_rendered_page_as_utf8_and_returns_its_path(tmp_path):
    page = Page("Température ✓").p("naïve")
    out = page.write(str(tmp_path / "r.html"))
    assert out == tmp_path / "r.html"
    assert out.read_bytes() == page.render().encode("utf-8")
