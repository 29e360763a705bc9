/* The TCP floor for rdma_baseline.py: a 64 B (-s) ping-pong over TCP between two processes,
 * blocking send/recv with TCP_NODELAY -- the socket twin of perftest's ib_send_lat (and, blocking
 * in the kernel for each answer, of ib_send_lat -e).  Prints "t_typical[usec] <median one-way>"
 * as perftest does (half the round trip), and the median round trip.
 *
 *   tcp_pingpong -p PORT [-s SIZE] [-n ITERS]            server (answers one client, exits)
 *   tcp_pingpong -p PORT [-s SIZE] [-n ITERS] ADDRESS    client
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int full(int fd, char *buf, int n, int sending) {
    int done = 0;
    while (done < n) {
        ssize_t r = sending ? send(fd, buf + done, n - done, 0) : recv(fd, buf + done, n - done, 0);
        if (r <= 0) return -1;
        done += (int)r;
    }
    return 0;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int port = 18600, size = 64, iters = 1000, opt;
    while ((opt = getopt(argc, argv, "p:s:n:")) != -1) {
        if (opt == 'p') port = atoi(optarg);
        else if (opt == 's') size = atoi(optarg);
        else if (opt == 'n') iters = atoi(optarg);
        else return 2;
    }
    char *buf = calloc(1, size);
    double *rtt = calloc(iters, sizeof(double));
    int one = 1, fd;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (optind < argc) {
        inet_pton(AF_INET, argv[optind], &sa.sin_addr);
        fd = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) { perror("connect"); return 1; }
    } else {
        int ls = socket(AF_INET, SOCK_STREAM, 0);
        setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        sa.sin_addr.s_addr = htonl(INADDR_ANY);
        if (bind(ls, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(ls, 1) < 0) { perror("listen"); return 1; }
        fd = accept(ls, NULL, NULL);
        close(ls);
    }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int client = optind < argc;
    for (int i = 0; i < iters; i++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        if (client) {
            if (full(fd, buf, size, 1) || full(fd, buf, size, 0)) { perror("client"); return 1; }
        } else {
            if (full(fd, buf, size, 0) || full(fd, buf, size, 1)) { perror("server"); return 1; }
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        rtt[i] = (t1.tv_sec - t0.tv_sec) * 1e6 + (t1.tv_nsec - t0.tv_nsec) / 1e3;
    }
    if (client) {
        qsort(rtt, iters, sizeof(double), cmp);
        printf(" #bytes #iterations t_typical[usec] rtt_median[usec]\n");
        printf(" %d %d %.2f %.2f\n", size, iters, rtt[iters / 2] / 2, rtt[iters / 2]);
    }
    close(fd);
    return 0;
}
