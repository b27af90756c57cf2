/* The pid 1 of a bwrap sandbox, compiled: guest/sandbox_init.py's protocol, without an interpreter's start.
 *
 *     sandbox-init GATE_FD -- ARGV...
 *     sandbox-init GATE_FD --hold
 *
 * Why a second implementation: every sandbox has a pid 1, and starting Python for it cost about 5 CPU-ms and
 * 2.7 MiB of private memory a sandbox (its interpreter's own start: 750 page faults), a tenth of a template
 * start's CPU. This program does the same in well under one CPU-ms. The Python init stays: it is what runs where
 * `coderunner setup` found no C compiler (sandbox/init_binary.py decides), and tests/unit/test_sandbox_init.py
 * holds both to one protocol, case by case.
 *
 * The protocol (read guest/sandbox_init.py for the reasons):
 * - it makes itself non-dumpable first (nothing in the sandbox may open /proc/1/mem for writing), refusing to
 *   start (exit 125) if that does not hold; it dies with bwrap's outer process (PR_SET_PDEATHSIG) and names
 *   itself "sandbox-init";
 * - it waits for one byte "1" on GATE_FD, whose only writer is the host; any other end of that wait (end of file,
 *   another byte, an error) exits 137, as does an end of file later (the host went away);
 * - ARGV: it forks and execs ARGV (no PATH search) with every signal at its default (whatever the host's side
 *   left ignored), an empty signal mask and without the gate, points its own stdin and stdout at /dev/null, reaps every orphan, and exits with ARGV's
 *   status (128 + the signal if a signal ended it);
 * - --hold: it starts nothing, writes "ready\n" on its stdout once the gate said go, and holds the sandbox,
 *   reaping, until the host goes away or kills it.
 *
 * One thread, no allocation; every wait is on the gate or a child (SIGCHLD is blocked but while in ppoll).
 * C99 and Linux's prctl; built static where the C library allows it (no dynamic loader at every start).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#define REFUSED 125
#define HOST_GONE 137
#define NAME "sandbox-init"
#define READY "ready\n"

static void say(const char *what, const char *detail) {
    char line[512];
    int n = snprintf(line, sizeof line, "sandbox init: %s%s\n", what, detail);
    if (n > 0) {
        ssize_t ignored = write(2, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
        (void)ignored;
    }
}

/* Non-dumpable, killed with bwrap's outer process, and named for what it is. */
static void seal(void) {
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 || prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) != 0) {
        say("cannot make pid 1 non-dumpable: not starting: ", strerror(errno));
        _exit(REFUSED);
    }
    prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    prctl(PR_SET_NAME, NAME, 0, 0, 0);
}

/* One byte from the gate: 1 for a byte, 0 for end of file or an error (the host is gone). */
static int read_gate(int gate, char *byte) {
    for (;;) {
        ssize_t got = read(gate, byte, 1);
        if (got == 1) return 1;
        if (got < 0 && errno == EINTR) continue;
        return 0;
    }
}

static void await_gate(int gate) {
    char byte = 0;
    if (!read_gate(gate, &byte) || byte != '1') _exit(HOST_GONE);
}

static void on_child(int number) { (void)number; }

/* Fork ARGV with default dispositions and an empty mask, without the gate; the parent gets its pid. */
static pid_t start(char **argv, int gate) {
    pid_t pid = fork();
    if (pid != 0) return pid;
    close(gate);
    for (int number = 1; number < NSIG; number++) { /* ours, and whatever the host's side left ignored */
        if (number != SIGKILL && number != SIGSTOP) signal(number, SIG_DFL); /* libc's own: EINVAL, harmless */
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    execv(argv[0], argv);
    char detail[512];
    snprintf(detail, sizeof detail, "%s: %s", argv[0], strerror(errno));
    say("cannot start ", detail);
    _exit(127);
}

static int status_of(int status) { return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status); }

/* Reap every child until `first` has exited (its status), or until the host went away (first < 0: only that). */
static int serve(pid_t first, int gate, const sigset_t *waiting_mask) {
    struct pollfd watched = {.fd = gate, .events = POLLIN};
    for (;;) {
        for (;;) {
            int status = 0;
            pid_t pid = waitpid(-1, &status, WNOHANG);
            if (pid < 0 && errno == EINTR) continue;
            if (pid < 0) {
                if (first < 0) break; /* holding: no orphan to reap now */
                return REFUSED;       /* cannot happen while `first` lives: it is our child */
            }
            if (pid == 0) break;
            if (pid == first) return status_of(status);
        }
        watched.revents = 0;
        int ready = ppoll(&watched, 1, NULL, waiting_mask); /* SIGCHLD unblocked only here */
        if (ready < 0 && errno != EINTR) return HOST_GONE;
        if (ready > 0) {
            if (watched.revents & (POLLERR | POLLNVAL)) return HOST_GONE;
            char byte;
            if (!read_gate(gate, &byte)) return HOST_GONE;
        }
    }
}

static int parse_fd(const char *text) {
    if (!*text) return -1;
    long value = 0;
    for (const char *c = text; *c; c++) {
        if (*c < '0' || *c > '9' || value > 1000000) return -1;
        value = value * 10 + (*c - '0');
    }
    return (int)value;
}

int main(int argc, char **argv) {
    int hold = argc == 3 && strcmp(argv[2], "--hold") == 0;
    int gate = argc >= 2 ? parse_fd(argv[1]) : -1;
    if (gate < 0 || !(hold || (argc >= 4 && strcmp(argv[2], "--") == 0))) {
        say("usage: sandbox-init GATE_FD (-- ARGV... | --hold)", "");
        return REFUSED;
    }
    signal(SIGINT, SIG_DFL); /* pid 1: ignored from inside, so code here cannot stop it */
    signal(SIGTERM, SIG_DFL);
    signal(SIGHUP, SIG_DFL);
    seal();
    await_gate(gate);

    sigset_t blocked, waiting_mask;
    sigemptyset(&blocked);
    sigaddset(&blocked, SIGCHLD);
    sigprocmask(SIG_BLOCK, &blocked, &waiting_mask);
    sigdelset(&waiting_mask, SIGCHLD);
    struct sigaction child = {.sa_handler = on_child};
    sigemptyset(&child.sa_mask);
    sigaction(SIGCHLD, &child, NULL);

    if (hold) { /* stdin and stdout stay open: the host reads READY, and an end of file would say it had exited */
        ssize_t ignored = write(1, READY, sizeof READY - 1);
        (void)ignored;
        _exit(serve(-1, gate, &waiting_mask));
    }
    pid_t first = start(argv + 3, gate);
    if (first < 0) {
        say("cannot fork: ", strerror(errno));
        _exit(REFUSED);
    }
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null >= 0) { /* the program's stdin and stdout are its own: a pipe's end is not held open here */
        dup2(null, 0);
        dup2(null, 1);
        close(null);
    }
    _exit(serve(first, gate, &waiting_mask));
}
