"""The long-running side of gpuwatch: the watcher, its event log and the services on it."""
