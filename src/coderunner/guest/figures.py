"""Figures left open at the end of a cell are sent as images, whatever the matplotlib backend.

The kernel starts with the inline backend, which shows and closes open figures itself (its
post_execute hook), but only those it saw drawn, and only if its hook was registered. Model-written
code often switches to a non-interactive backend first (`matplotlib.use('Agg')`, then
`plt.show()`), which shows nothing and only warns. This hook runs after every cell (post_run_cell,
so after the inline backend's own hook) and sends each figure still open as a PNG, then closes it:
whatever showed a figure closed it, so each is sent once and never again. The one exception is the
inline backend told to keep figures (InlineBackend.close_figures = False): the user asked for that.
It never imports matplotlib itself: a cell that did not use pyplot costs one dict lookup.
"""

import base64
import io
import sys
import warnings

INLINE_BACKENDS = ("inline", "module://matplotlib_inline.backend_inline")
#: What `plt.show()` warns under Agg and other non-interactive backends; the figure is sent anyway.
NOT_SHOWN_WARNING = r".*non-interactive, and thus cannot be shown"


def _backend(matplotlib):
    try:
        return matplotlib.get_backend(auto_select=False)  # 3.10+: never resolves (or imports) one
    except TypeError:
        return matplotlib.rcParams._get("backend")


def _png(figure):
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _keeps_figures(matplotlib):
    """Whether the inline backend is active and configured to keep figures open across cells."""
    config = sys.modules.get("matplotlib_inline.config")
    if config is None or _backend(matplotlib) not in INLINE_BACKENDS:
        return False
    return not config.InlineBackend.instance().close_figures


def send_open_figures():
    """Show and close the figures pyplot still holds (see the module's docstring for the exception)."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None or _keeps_figures(sys.modules["matplotlib"]):
        return
    from IPython.display import display

    numbers = pyplot.get_fignums()
    try:
        for number in numbers:
            figure = pyplot.figure(number)
            summary = f"<Figure size {figure.bbox.width:g}x{figure.bbox.height:g} with {len(figure.axes)} Axes>"
            display({"image/png": _png(figure), "text/plain": summary}, raw=True)
    except Exception as exc:  # a figure that cannot be drawn must not break the cell's reply
        print(f"[a figure could not be sent as an image: {type(exc).__name__}: {exc}]", file=sys.stderr)
    finally:
        if numbers:
            pyplot.close("all")


def _after_cell(result):
    send_open_figures()


def install(ipython):
    warnings.filterwarnings("ignore", message=NOT_SHOWN_WARNING, category=UserWarning)
    if _after_cell not in ipython.events.callbacks["post_run_cell"]:
        ipython.events.register("post_run_cell", _after_cell)
