// Package inbox is the worker side of the transactional inbox: ingest stores
// each message in the inbox table once, and a Worker hands the stored
// messages to a Handler and records what came of each. What a Worker
// promises:
//
//   - One transaction for the handler's effects and the outcome. A batch is
//     claimed with FOR UPDATE SKIP LOCKED, so that any number of Workers, in
//     any number of processes, share one inbox, and a row another session
//     holds is passed over, not waited for. One transaction then locks the
//     claimed rows, runs the handler and marks each message processed,
//     retried or dead: the handler's database effects and the outcomes
//     commit together, or not at all.
//   - A savepoint per message. The batch is handled under a savepoint; when
//     the handler fails it as a whole, each message is handled again alone,
//     under a savepoint of its own, so that one bad message (a broken
//     statement, a panic, a query past its share of HandlerTimeout) costs
//     the others nothing.
//   - Attempts that survive a rollback. The claim counts an attempt and
//     commits before the handler runs: a message whose handling kills the
//     process, or loses the transaction, still uses up its attempts, and ends
//     dead after MaxAttempts instead of crash-looping. A message that waits
//     (Wait, lock_timeout) gets its attempt back.
//   - Per-order order. A message is claimed only when no earlier message of
//     its order key is still open (pending, claimed, waiting for a retry, or
//     dead): each order's messages are handled one at a time, in arrival
//     order, a dead one holding its order until an operator skips or replays
//     it, while the other orders go on.
//   - Takeover of dead processes' claims. Each process holds a liveness lock
//     on a session of its own, and its claims carry the lock's key: the
//     claims of a process whose session ended are taken over by the other
//     Workers at once, those whose process's liveness is unknown once their
//     ClaimLease has passed. A message that lost a claim before is handled
//     alone, so that if it kills a process again it costs no other message
//     an attempt.
//
// The Handler says what came of each message with an Outcome: processed, a
// retry after a backoff (or after RetryAfter's delay), dead at once
// (Permanent), or a wait that does not count (Wait).
package inbox
