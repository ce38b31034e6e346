"""Views of one request's DCP layout, for people: the numbers of a view, text and pictures.

``layout_view`` computes what a view shows, only through ``dcpsim.model.layout``;
``layout_text`` prints it, ``layout_picture`` draws it (matplotlib, imported lazily), and
``failure`` turns the first failure of a run report into a view and its marks. The
package reads the pure model only: never the engine, the checker or the harness.
"""
