"""The common imports, paid for by a kernel started ahead (a warm pool member, a session's standby).

The host runs `run()` in such a kernel as a silent cell (no history, no execution count, no output
kept, no name bound in the user's namespace: WARM_UP_CODE in sessions/warm_up.py) before anyone
uses it, so that a new session's first chart or first pandas cell finds numpy, pandas and pyplot
imported and their first-use work done: the Agg renderer has drawn text (fonts loaded) and written
a PNG, a frame has been printed and described. What it leaves is what those imports leave in any
kernel (modules in sys.modules, their caches); nothing of the user's changes.

matplotlib's backend is not chosen here: the user's first figure chooses it, as in any kernel (the
inline one, or whatever `matplotlib.use()` asked for first). The figure drawn here is made without
pyplot, so pyplot has no figure, number or hook of it. Any failure (a package missing or broken)
ends the warm-up quietly: the user's own import then says what is wrong.
"""


def run():
    try:  # noqa: SIM105 (the reason beside it)
        _warm()
    except Exception:  # never the warm-up's failure: the kernel is as good as a cold one
        pass


def _warm():
    import io

    import matplotlib.pyplot  # noqa: F401 (imported for sys.modules: the user's `import` finds it)
    import numpy
    import pandas
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(2, 1.5))
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    axes.plot(numpy.arange(3), numpy.arange(3) ** 2)
    axes.set_title("warm")
    figure.savefig(io.BytesIO(), format="png", bbox_inches="tight")
    frame = pandas.DataFrame({"x": range(3), "y": [0, 1, 0]})
    repr(frame)
    frame._repr_html_()
    frame.groupby("y").x.describe()
