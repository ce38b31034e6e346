"""The compiled code of a source tree's modules, kept between processes (``$DCPSIM_CACHE/code``).

Loading a tree executes its modules from source; compiling them is most of the cost when Python
keeps no bytecode of its own (``PYTHONDONTWRITEBYTECODE``, a read-only tree), and every process
that loads a tree (the parent's check, the ranks' forkserver, a rank) pays it again.
``CachedSourceLoader`` keeps each module's code object, marshalled under a key of its source's
SHA-256 and the interpreter's bytecode magic number: an edited file (a bug planted in a copy of
the tree) or another Python never reuses another's code, while the unchanged files of a copy
share the original's (the cache grows by the distinct sources, not by the copies). The code's
file name is set to the file loaded (tracebacks and ``SourceTree.frames`` name it). A cache
that cannot be read or written is skipped: the module is compiled as before.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import marshal
import os
import tempfile
import types

from dcpsim.cache import cache_dir


class CachedSourceLoader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname):
        path = self.get_filename(fullname)
        source = self.get_data(path)
        key = hashlib.sha256(importlib.util.MAGIC_NUMBER + source).hexdigest()
        folder = cache_dir("code", key[:2])
        file = folder / f"{key}.code"
        try:
            return with_filename(marshal.loads(file.read_bytes()), path)
        except (OSError, ValueError, EOFError, TypeError):
            pass
        code = self.source_to_code(source, path)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
            with os.fdopen(fd, "wb") as out:
                out.write(marshal.dumps(code))
            os.replace(tmp, file)  # atomic: concurrent loaders read a whole file or none
        except OSError:
            pass
        return code


def with_filename(code: types.CodeType, path: str) -> types.CodeType:
    """``code`` and every code object inside it (functions, classes) naming ``path`` as its file."""
    if code.co_filename == path:
        return code
    consts = tuple(with_filename(c, path) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=path, co_consts=consts)
