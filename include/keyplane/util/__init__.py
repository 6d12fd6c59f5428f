"""Small helpers shared by every layer: atomic files, child processes, progress bars."""
