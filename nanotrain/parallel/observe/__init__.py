"""What a rank records about its own progress, read by the hang watchdog, the straggler report
and the logs: where it is (``hang_record``), how long its phases took (``timing``) and how long it
sat blocked on its peers (``wait_clock``)."""
