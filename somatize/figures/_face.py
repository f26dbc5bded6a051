"""The static face every figure carries beside its live view: `text/html` (its picture as an
image, an SVG in a data URI, which a sanitizer keeps for an untrusted notebook) and a
`text/plain` line, for wherever no widget is drawn (nbconvert, GitHub, a notebook reopened).

Shown in a notebook, a figure is two outputs: the live view (and its line), then the face
alone, with a style that hides it once the live view is drawn in the same page. A saved
notebook that keeps the widgets' state (`jupyter nbconvert --execute` does) is converted to
HTML as the widget's view, which needs a widget manager from the network: the face, an output
of its own, is drawn there anyway. The face is brought up to date at the end of every cell.
"""

from __future__ import annotations

import base64
import warnings
import weakref
from html import escape
from pathlib import Path
from typing import Any

from somatize.figures._page import jsonable, page

START = '<div class="smz-face" style="max-width:100%;overflow-x:auto">'
END = "</div><!--/smz-face-->"
# Hides a face shown on its own, and its output, once the live view (which carries the class
# smz-live-<model id>) is drawn anywhere in the page; where styles are dropped, it shows.
_HIDDEN = (
    "<style>body:has(.smz-live-{key}) .jp-OutputArea-child:has([data-smz-for='{key}']),"
    " body:has(.smz-live-{key}) [data-smz-for='{key}'] {{display:none}}</style>"
)


class Face:
    """What a figure adds to an anywidget, from its `svg()` (its picture), `face()` (that
    picture as HTML, what its output bundle carries) and `plain()` (one line saying what it
    shows): `save_svg`, `save_html`, `state`, and the bundle kept current where it was shown."""

    _bundle = ""  # its browser half in a saved page: static/<bundle>.js, as its _esm
    _saved: tuple[str, ...] = ()  # the traits a saved page draws from

    def state(self) -> dict[str, Any]:
        """The figure's traits as one dict, what it holds complete (a live audit's record
        too): what a saved page draws from."""
        self.settle()
        return {k: jsonable(getattr(self, k)) for k in self._saved}

    def save_svg(self, path: str | Path) -> Path:
        """Write the picture as an SVG file (UTF-8)."""
        return written(path, self.svg())

    def save_html(self, path: str | Path) -> Path:
        """Write a standalone page with the figure working in it as it does live (hover, fit,
        pan and zoom, a minimap; an audit's every metric and its menu; a table's sorting,
        toggles and scatter), drawn offline: its browser half and its state are inside the
        page. What needs a kernel (opening a graph's node or block) stays as it was saved."""
        return written(path, page([(self._bundle, self.state())], title=self.plain()))

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = super()._repr_mimebundle_(**kwargs)  # type: ignore[misc]
        data, meta = bundle if isinstance(bundle, tuple) else (bundle or {}, {})
        face = self.__dict__["_face_shown"] = self.face()
        return {**data, "text/plain": self.plain(), "text/html": START + face + END}, meta

    def _ipython_display_(self) -> None:
        from IPython.display import display

        live = f"smz-live-{self.model_id}"
        if live not in self._dom_classes:  # type: ignore[attr-defined]
            self.add_class(live)  # type: ignore[attr-defined]
        data, meta = self._repr_mimebundle_()
        live_view = {k: v for k, v in data.items() if k != "text/html"}
        display(live_view, metadata=meta, raw=True)
        handle = display(self._alone(), raw=True, display_id=True)
        if handle is not None:
            self.__dict__.setdefault("_face_handles", []).append(handle)
            _refresh_after_cells(self)

    def _alone(self) -> dict[str, str]:
        """The face last drawn as an output of its own, hidden where the live view is drawn."""
        key = self.model_id  # type: ignore[attr-defined]
        tagged = START[:-1] + f' data-smz-for="{key}">' + _HIDDEN.format(key=key)
        return {"text/html": tagged + self.__dict__["_face_shown"] + END}

    def refresh(self) -> bool:
        """Bring the face of every place this figure was shown up to date, if it changed;
        whether it had. Called at the end of each cell; call it to do it now."""
        handles = self.__dict__.get("_face_handles", [])
        if not handles:
            return False
        self.settle()
        shown = self.__dict__.get("_face_shown")
        self._repr_mimebundle_()  # draws the face once, and keeps it
        if self.__dict__["_face_shown"] == shown:
            return False
        for handle in handles:
            handle.update(self._alone(), raw=True)
        return True

    def settle(self) -> None:
        """Make what the face will show complete (a live audit sends what it holds)."""


def written(path: str | Path, text: str) -> Path:
    """Write `text` to `path` (UTF-8); answers the path."""
    path = Path(path)
    path.write_text(text, encoding="utf-8")
    return path


def image(svg: str, alt: str) -> str:
    """An SVG as an HTML image (a data URI), at its own size or narrower."""
    data = base64.b64encode(svg.encode("utf-8")).decode("ascii")
    alt = escape(alt, quote=True)
    return f'<img alt="{alt}" style="max-width:100%" src="data:image/svg+xml;base64,{data}"/>'


_watched: weakref.WeakSet = weakref.WeakSet()


def _refresh_after_cells(figure: Face) -> None:
    """Register (once per kernel) an end-of-cell hook that refreshes every figure shown."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return
    _watched.add(figure)
    if not getattr(shell, "_somatize_faces", False):
        shell._somatize_faces = True
        shell.events.register("post_run_cell", _after_cell)


def _after_cell(*_: Any) -> None:
    for figure in list(_watched):
        try:
            figure.refresh()
        except Exception as err:  # a figure that cannot draw must not break the next cell
            name = type(figure).__name__
            warnings.warn(f"{name}'s static face was not refreshed: {err}", stacklevel=1)
