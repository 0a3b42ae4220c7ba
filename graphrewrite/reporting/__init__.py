"""What people and machines read: the optimize and inspect reports, plots, graph diffs."""

__all__ = ["diff", "plot", "report", "summary"]
