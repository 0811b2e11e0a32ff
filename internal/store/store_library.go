package store

import (
	"context"
	"database/sql"
	"devicehub/internal/model"
	"errors"
)

// The store's side of the team's firmware library (library.go): files
// uploaded to the team rather than to a device, listed together with
// every file the team's devices hold, one entry per sha256.

// ErrLibraryHasFile: the library already holds a file with that sha256.
var ErrLibraryHasFile = errors.New("the library already has this file")

// ErrFirmwareInUse: a library file that a device's firmware row still uses.
var ErrFirmwareInUse = errors.New("a device has this firmware")

// teamFiles is every file the team holds, one row each: a library entry,
// or device firmware rows (rank 1); listed and picked from by the
// library's queries. ?1 is the team.
const teamFiles = `WITH held AS (
		SELECT l.sha256, l.md5, l.name, l.version, l.notes, l.size, l.platform, l.uploaded_by, l.created_at, 0 AS rank, l.id
		FROM library_firmwares l WHERE l.team_id = ?1
		UNION ALL
		SELECT f.sha256, f.md5, f.name, f.version, f.notes, f.size, NULL, NULL, f.created_at, 1, f.id
		FROM firmwares f JOIN devices d ON d.id = f.device_id WHERE d.team_id = ?1
	), picked AS (
		SELECT *, row_number() OVER (PARTITION BY sha256 ORDER BY rank, id) AS n FROM held
	)`

// libraryQuery reads LibraryFirmwares from picked (p): the library's
// entry when there is one, else the file's first device row, with how
// many of the team's devices run it and target it, each counted in one
// grouped pass over the team's devices (two subqueries per entry took a
// second at 300 entries on 3,000 devices). It ends in a WHERE that may
// go on.
const libraryQuery = teamFiles + `, running AS (
		SELECT current_md5 AS md5, count(*) AS n FROM devices WHERE team_id = ?1 AND current_md5 IS NOT NULL
		GROUP BY current_md5
	), targeting AS (
		SELECT f.sha256, count(*) AS n FROM devices d JOIN firmwares f ON f.id = d.target_firmware_id
		WHERE d.team_id = ?1 GROUP BY f.sha256
	)
	SELECT p.sha256, p.md5, p.name, p.version, p.notes, p.platform, p.size, u.id, u.name, p.created_at,
		coalesce(r.n, 0), coalesce(t.n, 0)
	FROM picked p LEFT JOIN users u ON u.id = p.uploaded_by
		LEFT JOIN running r ON r.md5 = p.md5 LEFT JOIN targeting t ON t.sha256 = p.sha256
	WHERE p.n = 1`

func scanLibraryFirmware(row scanner) (*model.LibraryFirmware, error) {
	f := &model.LibraryFirmware{}
	var byID sql.NullInt64
	var byName sql.NullString
	err := row.Scan(&f.SHA256, &f.MD5, &f.Name, &f.Version, &f.Notes, &f.Platform, &f.Size, &byID, &byName, &f.CreatedAt,
		&f.DevicesRunning, &f.DevicesTargeting)
	if err != nil {
		return nil, notFound(err, ErrFirmwareNotFound)
	}
	if byID.Valid {
		f.UploadedBy = &model.ActorRef{ID: byID.Int64, Name: byName.String}
	}
	return f, nil
}

// LibraryFirmwares lists every file the team holds, newest first.
func (s *Store) LibraryFirmwares(ctx context.Context, teamID int64) ([]*model.LibraryFirmware, error) {
	return queryAll(ctx, s.reader, scanLibraryFirmware, libraryQuery+` ORDER BY p.created_at DESC, p.sha256`, teamID)
}

// libraryFirmwareQuery is the team's entry for the file with that sha256.
func libraryFirmwareQuery(ctx context.Context, q queryer, teamID int64, sha string) (*model.LibraryFirmware, error) {
	return scanLibraryFirmware(q.QueryRowContext(ctx, libraryQuery+` AND p.sha256 = ?2`, teamID, sha))
}

// NewLibraryFirmware is an upload into the library: the firmware, the
// platform its image was checked for ("" for none) and who sent it.
type NewLibraryFirmware struct {
	NewFirmware
	Platform   *string
	UploadedBy int64
}

// CreateLibraryFirmware stores the upload's file and adds the library's
// entry (addWithFile), as CreateFirmware does for a device's; the audit
// entry commits with it. The team's byte quota counts it once.
// ErrLibraryHasFile for a file it has.
func (s *Store) CreateLibraryFirmware(ctx context.Context, teamID int64, nf NewLibraryFirmware, audit Audit[*model.LibraryFirmware]) (*model.LibraryFirmware, error) {
	var f *model.LibraryFirmware
	check := func(tx *sql.Tx) error {
		var exists bool
		err := tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM library_firmwares WHERE team_id = ? AND sha256 = ?)`,
			teamID, nf.SHA256).Scan(&exists)
		if err != nil {
			return err
		}
		if exists {
			return ErrLibraryHasFile
		}
		return s.checkLibraryQuotas(ctx, tx, teamID, nf.Size)
	}
	add := func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO library_firmwares (team_id, name, version, notes, platform, md5, sha256, size,
			uploaded_by, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`, teamID, *nf.Name, nf.Version, nf.Notes, nf.Platform,
			nf.MD5, nf.SHA256, nf.Size, nf.UploadedBy, s.Timestamp())
		if err != nil {
			return err
		}
		if f, err = libraryFirmwareQuery(ctx, tx, teamID, nf.SHA256); err != nil {
			return err
		}
		return insertAudit(ctx, tx, audit, f)
	}
	err := s.addWithFile(ctx, nf.NewFirmware, check, add)
	return f, err
}

// checkLibraryQuotas refuses a new library file of size bytes with a
// QuotaError when the team's library holds -max-library-files files, or
// when the file would take the team past -max-firmware-mib.
func (s *Store) checkLibraryQuotas(ctx context.Context, tx *sql.Tx, teamID, size int64) error {
	if max := s.limits.LibraryFiles; max > 0 {
		var n int
		if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM library_firmwares WHERE team_id = ?`, teamID).Scan(&n); err != nil {
			return err
		}
		if n >= max {
			return &QuotaError{Quota: QuotaLibraryFiles, Limit: max}
		}
	}
	used, err := s.firmwareBytesUsed(ctx, tx, teamID)
	if err != nil {
		return err
	}
	if mib := s.limits.FirmwareMiB; mib > 0 && used+diskBytes(size) > int64(mib)<<20 {
		return &QuotaError{Quota: QuotaFirmwareMiB, Limit: mib}
	}
	return nil
}

// DeleteLibraryFirmware removes the library's entry for the file, and the
// file unless another team holds it; audit's entry, of the entry removed,
// commits with it. ErrFirmwareInUse while a device of the team has a
// firmware row of it; ErrFirmwareNotFound when the team holds no such
// file.
func (s *Store) DeleteLibraryFirmware(ctx context.Context, teamID int64, sha string, audit Audit[*model.LibraryFirmware]) error {
	_, err := s.deleteWithFiles(ctx, func(tx *sql.Tx) ([]string, error) {
		f, err := libraryFirmwareQuery(ctx, tx, teamID, sha)
		if err != nil {
			return nil, err
		}
		var used bool
		err = tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM firmwares f JOIN devices d ON d.id = f.device_id
			WHERE d.team_id = ? AND f.sha256 = ?)`, teamID, sha).Scan(&used)
		if err != nil {
			return nil, err
		}
		if used {
			return nil, ErrFirmwareInUse
		}
		if _, err = tx.ExecContext(ctx, `DELETE FROM library_firmwares WHERE team_id = ? AND sha256 = ?`, teamID, sha); err != nil {
			return nil, err
		}
		return []string{sha}, insertAudit(ctx, tx, audit, f)
	})
	return err
}

// rolloutSource is the file a rollout sends: the team's file with the
// md5, from its library or a device, with the name, version and notes
// that the firmware rows the rollout gives its devices copy, and the
// platform a library upload was checked for.
type rolloutSource struct {
	name, version, notes, platform *string
	sha256                         string
	size                           int64
}

// rolloutSourceOf finds the team's file with that md5. ErrFirmwareNotFound
// when the team has none; ErrMD5OfTwoFiles when it has two.
func rolloutSourceOf(ctx context.Context, q queryer, teamID int64, md5sum string) (rolloutSource, error) {
	var src rolloutSource
	var files int
	err := q.QueryRowContext(ctx, teamFiles+` SELECT (SELECT count(DISTINCT sha256) FROM held WHERE md5 = ?2),
		p.name, p.version, p.notes, p.platform, p.sha256, p.size FROM picked p WHERE p.md5 = ?2
		ORDER BY p.rank, p.id LIMIT 1`, teamID, md5sum).
		Scan(&files, &src.name, &src.version, &src.notes, &src.platform, &src.sha256, &src.size)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return src, ErrFirmwareNotFound
	case err != nil:
		return src, err
	case files > 1:
		return src, ErrMD5OfTwoFiles
	}
	return src, nil
}

// firmwareLabelOf names the team's file with that sha256: its library
// entry's name and version, else its first device row's; nil when the
// team no longer holds it, or sha is nil (a revert to several files).
func firmwareLabelOf(ctx context.Context, q queryer, teamID int64, sha *string) (*model.FirmwareLabel, error) {
	l := &model.FirmwareLabel{}
	err := q.QueryRowContext(ctx, `SELECT name, version FROM (
			SELECT name, version, 0 AS rank, id FROM library_firmwares WHERE team_id = ?1 AND sha256 = ?2
			UNION ALL
			SELECT f.name, f.version, 1, f.id FROM firmwares f JOIN devices d ON d.id = f.device_id
			WHERE f.sha256 = ?2 AND d.team_id = ?1)
		ORDER BY rank, id LIMIT 1`, teamID, sha).Scan(&l.Name, &l.Version)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, nil
	}
	return l, err
}
