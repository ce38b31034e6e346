"""Read-only analyses and views for people, over the pure model and what a run hands them.

* ``capacity``, ``interleave``, ``backend_rules``, ``interleave_plot``: the arithmetic and
  statistics of the ``capacity`` and ``interleave`` commands;
* ``layout_view`` computes what a layout view shows, only through ``dcpsim.model.layout``;
  ``layout_text`` prints it, ``layout_picture`` draws it (matplotlib, imported lazily), and
  ``failure`` turns the first failure of a run report into a view and its marks.

The package never imports the engine, the checker, the harness or the commands.
"""
