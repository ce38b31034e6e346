"""What one KV-store state holds in dcpsim: a fingerprint row of five int64 fields.

``group`` (the KV-cache group that wrote it), ``index`` (global position, record index or
ring state), ``content`` (the prefix fingerprint of the token stream, ``dcpsim.model.content``),
``writer`` (request index) and ``step``. An unwritten state holds ``EMPTY`` in every field.
The worker writes rows in this format and the checker reads them; neither side owns it.
"""

FIELDS = ("group", "index", "content", "writer", "step")
GROUP, INDEX, CONTENT, WRITER, STEP = range(len(FIELDS))
EMPTY = -1
