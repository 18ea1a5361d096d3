"""The trace's vocabulary: its columns, their dtypes, and the events a run records (``Controller.trace``, one row
per event). A bottom module, so the controller, the run loop and the CLI all read the names from here."""

TRACE_COLUMNS = [
    "seq", "event", "trainer_version", "group_id", "weight_version", "target_step", "lag", "detail", "reason",
]
TRACE_EVENTS = (
    "admit", "refuse", "dispatch", "commit", "evict", "select", "train", "sync", "abort", "step", "fault", "skip",
)
TRACE_DTYPES = {"seq": "int64", "trainer_version": "int64", "group_id": "Int64", "weight_version": "Int64",
                "target_step": "Int64", "lag": "Int64"}
