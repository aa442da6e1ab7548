package pipeline

// PlannerSettings are the PostgreSQL settings of every session that runs
// the pipeline's statements, as connection parameters. They keep the plans
// of the claims and the batch statements right on tables that nobody
// vacuums or analyzes, which is what a fresh schema is, and every schema
// on a server that runs without autovacuum:
//
//   - plan_cache_mode=force_custom_plan plans each statement for the tables
//     as they are. A cached generic plan is kept until something
//     invalidates it, and without ANALYZE nothing does: a plan made while
//     the inbox was empty goes on scanning the whole inbox on every batch
//     once it holds a million rows.
//   - enable_bitmapscan=off leaves the planner plain index scans where it
//     would have used a bitmap. The claims read partial indexes (pending
//     inbox rows, unpublished outbox rows) whose entries for rows that left
//     them stay until VACUUM. A plain index scan marks each such entry dead
//     as it passes it, so the next claim skips it; a bitmap scan visits the
//     heap for every one of them, on every claim, and marks nothing: on an
//     outbox of 40,000 published rows, 6,157 pages per claim against 111.
func PlannerSettings() map[string]string {
	return map[string]string{
		"plan_cache_mode":   "force_custom_plan",
		"enable_bitmapscan": "off",
	}
}
