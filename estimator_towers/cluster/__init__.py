"""The tasks of a synchronous cluster, and one machine as a group of one.

The task group (one_machine on one machine, task_sync across tasks), each
task's part of the batch (task_input), the start's agreement
(task_agreement), stuck or gone peers (peer_watch) and a task's server
(cluster_server).
"""
