import time

# when this process began running rlkit (its first import: a command's entry point), on the clock
# a command's start-up is timed by. Not the process's creation: a shell's last command is exec'd in
# the shell's own process, created before whatever the shell ran first.
STARTED = time.perf_counter()
