"""What the studies share: timing and reports (``common``), the workloads, the contenders, the
shaped link (``link``), peak RSS (``rss``), Python overhead (``overhead``), and how a study starts
itself again (``launch``)."""
