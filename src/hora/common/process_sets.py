"""``horovod.common.process_sets``: process sets, as every binding offers them."""

from hora.core.api import add_process_set, remove_process_set
from hora.core.process_sets import ProcessSet, global_process_set

__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]
