/* The pod sandbox ("pause") process of the dev cluster's real node (hack/node-bins.sh builds it
 * with gcc -static; hack/images/pause.py packs it into an OCI image). It holds the pod's
 * namespaces: sleeps until SIGINT/SIGTERM and, as PID 1 of a pod with a shared PID namespace,
 * reaps zombies. Same behaviour as Kubernetes' build/pause/linux/pause.c, written anew. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) {
  (void)sig;
  _exit(0);
}

static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    puts("rlenergy-pause 1");
    return 0;
  }
  struct sigaction stop = {.sa_handler = on_stop};
  struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0 ||
      sigaction(SIGCHLD, &child, NULL) < 0) {
    perror("sigaction");
    return 1;
  }
  for (;;) pause();
}
