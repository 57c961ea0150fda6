"""The fork server's last preload (`engine.launch`): freeze what it has imported.

Imported for its effect, once, in the fork server only. Frozen objects are left out of garbage
collection: the server's exit (when its launcher is gone) no longer walks all of torch (about
1 s, during which it holds the job's stdout open), and the workers forked from it do not touch
those pages again (no copy on write).
"""

import gc

__all__: list[str] = []  # imported for its effect only

gc.freeze()
